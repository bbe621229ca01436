"""The peers ``bench latency --compare`` measures pieceworks against, one loop per file."""
