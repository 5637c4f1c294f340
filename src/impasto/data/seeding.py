"""Stable seed derivation, used wherever a seed comes from (seed, epoch, index, ...)."""

from __future__ import annotations

import hashlib
import operator

SEED_BITS = 63


def derive_seed(*values: int) -> int:
    """Hash a sequence of integers into a non-negative 63-bit seed.

    The hash is BLAKE2b over the decimal text of each value, so the result is the same on every
    platform, Python version and process (unlike ``hash()``), and nearby inputs such as
    ``(seed, epoch)`` and ``(seed, epoch + 1)`` give unrelated seeds. 63 bits keep the seed valid
    for ``torch.Generator.manual_seed`` and ``numpy.random.default_rng``.

    Args:
        *values: one or more integers (Python or numpy), e.g. ``(seed, epoch, sample_index)``.

    Returns:
        An integer in ``[0, 2**63)``.
    """
    if not values:
        raise ValueError("derive_seed needs at least one integer; pass e.g. (seed, epoch)")
    integers = []
    for value in values:
        # bool is an int subclass, but a flag passed as a seed is almost certainly a bug.
        try:
            if isinstance(value, bool):
                raise TypeError
            integers.append(operator.index(value))  # also accepts numpy integers
        except TypeError:
            raise ValueError(
                f"derive_seed got {value!r} of type {type(value).__name__}; pass integers"
            ) from None
    text = ",".join(str(value) for value in integers).encode("ascii")
    digest = hashlib.blake2b(text, digest_size=8, person=b"impasto-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)
