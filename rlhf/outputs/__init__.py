"""What a run writes into its directory: atomic file writes (fileio), metrics.jsonl, wandb, the
console and progress bars (log). The report and summary tools that read it back are rlhf/report.py,
rlhf/summary.py."""
