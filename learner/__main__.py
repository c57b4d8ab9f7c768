"""`python -m learner --run-dir RUN`: started by the orchestrator, reads RUN/config.json.

Exit codes (runtime.lifecycle): 0 trained to the end, 4 a reward function failed, the
eval prompts do not load, a TCP run has no keys or a user's loss (`algorithm.name =
"module:Class"`) does not load (a restart would fail again), 5 the run
directory belongs to another live run, 128 + N stopped by signal N after a checkpoint, 1 anything unexpected.
"""

import argparse
import logging

from rewards.functions import RewardError
from runtime import lifecycle
from runtime.config import ConfigError
from transport.keys import KeysError


def cli() -> None:
    parser = argparse.ArgumentParser(prog="learner")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from learner.service import main
    from policy.data import DataError

    lifecycle.exit_with(
        lambda: main(args.run_dir, args.resume),
        logging.getLogger("learner"),
        (RewardError, DataError, KeysError, ConfigError),
    )


if __name__ == "__main__":
    cli()
