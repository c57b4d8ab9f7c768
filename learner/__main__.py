"""`python -m learner --run-dir RUN`: started by the orchestrator, reads RUN/config.json.

Exit codes (protocol.lifecycle): 0 trained to the end, 4 a reward function failed (a
restart would fail again), 5 the run directory belongs to another live run, 128 + N
stopped by signal N after a checkpoint, 1 anything unexpected.
"""

import argparse
import logging
import sys

from protocol import lifecycle
from rewards.functions import RewardError


def cli() -> None:
    parser = argparse.ArgumentParser(prog="learner")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("learner")
    from learner.service import main

    try:
        sys.exit(main(args.run_dir, args.resume))
    except RewardError as e:
        log.error("user error, not retried: %s", e)
        sys.exit(lifecycle.EXIT_USER_ERROR)
    except lifecycle.RunBusy as e:
        log.error("%s", e)
        sys.exit(lifecycle.EXIT_BUSY)
    except lifecycle.ForcedStop as e:
        log.error("%s again: stopping without a checkpoint", e)
        sys.exit(lifecycle.signal_exit_code(e.signum))


if __name__ == "__main__":
    cli()
