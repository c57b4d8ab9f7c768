"""`python -m learner --run-dir RUN`: started by the orchestrator, reads RUN/config.json.

Exit codes (runtime.lifecycle): 0 trained to the end, 4 a reward function failed, the
eval prompts do not load, a TCP run has no keys or a user's loss (`algorithm.name =
"module:Class"`) does not load or claims group_local wrongly (a restart would fail again), 5 the run
directory belongs to another live run, 128 + N stopped by signal N after a checkpoint, 1 anything unexpected.
"""

import argparse
import logging
from pathlib import Path

from rewards.functions import RewardError
from runtime import lifecycle
from runtime.config import ConfigError
from transport.keys import KeysError

log = logging.getLogger("learner")


def main(run_dir: str, resume: bool = False) -> int:
    """Run the learner to the end; returns the exit code (runtime.lifecycle)."""
    from learner.ranks import Ranks, follower_main
    from learner.service import Learner
    from policy.memory import apply_memory_share
    from runtime import spans
    from runtime.heartbeat import start_heartbeat

    ranks = Ranks.join()  # more than one under `mlx.launch` (learner/ranks.py)
    if ranks.rank > 0:
        return follower_main(run_dir, ranks)
    signals = lifecycle.StopSignals().install()
    lifecycle.watch_lifeline()
    lifecycle.hold_run_lock(run_dir)  # before the heartbeat: a refused learner touches nothing
    start_heartbeat(run_dir, "learner")
    apply_memory_share()
    learner = Learner.from_run_dir(Path(run_dir), resume, signals, ranks)
    spans.start(run_dir, "learner", learner.cfg.log.timeline)
    # A crash is restarted: the workers wait for the new learner; so they do when only this
    # process is stopped (a restart, or its orchestrator died: a resume comes).
    reason, final = "the learner failed", False
    try:
        learner.run()
        if signals.requested:
            reason, final = f"learner stopped by {signals.name}", lifecycle.stop_is_final(run_dir)
        else:
            reason, final = "training finished", True
    except RewardError:
        reason, final = "a reward function failed", True  # a user error: the run is over
        raise
    finally:
        learner.close(reason, final)
    done = "stopped" if signals.requested else "finished"
    log.info("%s at step %d; adapters in %s", done, learner.step, Path(run_dir) / "adapters")
    return signals.exit_code()


def cli() -> None:
    parser = argparse.ArgumentParser(prog="learner")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from policy.data import DataError

    lifecycle.exit_with(
        lambda: main(args.run_dir, args.resume),
        logging.getLogger("learner"),
        (RewardError, DataError, KeysError, ConfigError),
    )


if __name__ == "__main__":
    cli()
