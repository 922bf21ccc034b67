"""One exception type for bad input and failed checks, and the guard that turns it into an exit code."""
import functools
import logging
import sys

log = logging.getLogger("eaglenest")


class EaglenestError(Exception):
    """A failure the user can act on. The message names the file, line or sample."""


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def exit_on_error(fn):
    """Run a command-line main: EaglenestError -> one clear line on stderr and exit 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        setup_logging()
        try:
            return fn(*args, **kwargs)
        except EaglenestError as e:
            log.error("%s", e)
            sys.exit(2)
    return wrapper
