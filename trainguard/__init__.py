"""trainguard: fault tolerance and checkpointing for distributed training.

The training-loop hook is the public face of the package::

    import trainguard

    session = trainguard.init(checkpoint_dir="ckpt", save_every=50)
    start = session.restore({"model": model, "optim": optimizer})  # next step to run
    for step in range(start, total_steps):
        ...
        session.step_done(step, state={"model": model, "optim": optimizer})
    session.close()

It works under ``trainguard run`` (talks to the node agent), under plain ``torchrun`` and in a lone process.
"""

from trainguard._version import __version__
from trainguard.errors import ConfigError, TrainguardError, UsageError

__all__ = ["__version__", "ConfigError", "TrainguardError", "UsageError", "init", "Session"]


def __getattr__(name: str):
    # The hook pulls in torch; keep `import trainguard` cheap for the CLI and the agent.
    if name in ("init", "Session"):
        from trainguard import hook

        return getattr(hook, name)
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
