"""The host's memory available now (MemAvailable), for what sizes itself by it."""


def available() -> int:
    """Bytes of /proc/meminfo's MemAvailable; 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
