"""`rollouts serve-env`: verifiers 0.4's env-server protocol in front of the plane's supervised env pool.

- `wire.py`: the ZMQ ROUTER and its frames.
- `runs.py`: one `run`, a supervised episode with the plane's re-dispatch rule, ended by one reply.
- `front.py`: `ServeEnvFront`: the pool's load (readiness = loaded), health, runs and cancels.
- `command.py`: the command line.
"""
