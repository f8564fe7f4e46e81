"""A reward that blocks verifiers' event loop, as a grader calling `time.sleep` (or a synchronous HTTP
client) inside an `async def` does: plugged in as `task.rewards.blocks.fn =
"framework_vf_tasks.blocking:blocks_on_mia"`, it holds the loop for good on the task about Mia (index 3)
and scores every other task at once. The serve-env fault table and its test use it."""

import time

import verifiers.v1 as vf

BLOCK_S = 3600.0  # for good, as far as any client is concerned


async def blocks_on_mia(task: vf.TaskData, trace: vf.Trace) -> float:
    if "Mia" in str(task.prompt):
        time.sleep(BLOCK_S)
    return 0.0
