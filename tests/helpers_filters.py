"""A dynamic-sampling filter for tests, loaded by path (tests.helpers_filters:reject_every_third)."""


def reject_every_third(samples) -> bool:
    return samples[0].metadata["draw"] % 3 != 0
