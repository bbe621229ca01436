"""The scheduler: requests, their queue order (a policy), KV blocks and state slots, and what a
step schedules (``SchedulerOutput``). It knows nothing of devices, models or runners."""
