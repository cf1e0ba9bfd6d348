"""Bad-input kinds that the owners' tests already cover, by pytest node id (parametrised ids count
every case). `make test-faults` runs them with the fault suite and the report counts them."""

from __future__ import annotations

OWNER_TESTS: dict[str, list[str]] = {}


if __name__ == "__main__":  # the node ids, for `make test-faults` to run with the fault suite
    print(" ".join(sorted({n for ids in OWNER_TESTS.values() for n in ids})))
