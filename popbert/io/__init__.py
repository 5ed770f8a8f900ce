"""What a run writes and is given: its directory (`run_dir`), checkpoints (`checkpoint`), and
every path a command names, checked before any work (`paths`)."""
