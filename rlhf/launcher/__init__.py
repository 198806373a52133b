"""Starting and watching a job: self-launch through torch.distributed.run (launch), heartbeats and
the exit code of a lost peer (watchdog), a single process's SIGINT/SIGTERM → checkpoint → exit
(interrupt)."""
