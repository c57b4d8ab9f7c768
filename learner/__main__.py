"""`python -m learner --run-dir RUN`: started by the orchestrator, reads RUN/config.json."""

import argparse
import logging
import sys

from rewards.functions import RewardError


def cli() -> None:
    parser = argparse.ArgumentParser(prog="learner")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from learner.service import main

    try:
        main(args.run_dir, args.resume)
    except RewardError as e:
        logging.getLogger("learner").error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    cli()
