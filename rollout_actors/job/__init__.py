"""The job the `rollouts` CLI runs: its run config, and the report and timeline of a run."""
