"""An environment module that cannot be imported: it depends on a package that is not installed.

`Ref("env_actors.faults.broken_import:BrokenImportEnv")` must make `start_env_pool` raise within seconds,
with this import's traceback in the message.
"""

import ray_rollouts_missing_dependency  # noqa: F401  (deliberately absent)

from env_actors.faults.envs import EchoEnv


class BrokenImportEnv(EchoEnv):
    """Never constructed: its module fails first."""
