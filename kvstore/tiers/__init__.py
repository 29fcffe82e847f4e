"""What moves down and back up: the policy, host and disk (LMDB) tiers, the shared Redis tier."""
