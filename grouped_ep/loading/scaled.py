"""A large tensor's conversion layout read off probes of a scaled-down shape.

transformers' checkpoint conversions of expert stacks (stack per-expert keys, split gate from
up, transpose) do not depend on the sizes of the dims they move: a probe of
Mixtral-8x22B's [8, 32768, 6144] stack needs 3 GiB, one of [8, 256, 48] finds the same keys
with every coordinate divided by 128. `converted._probed_layout` probes at two scales, every
large dim divided by f and by f / 2; a layout whose coordinates on those dims double from the
first to the second, and are otherwise equal, is taken to grow with them, and is multiplied
up to the real shape. A conversion that does not scale so (interleaved rows, a rotary
permutation, a split at a fixed size, a dim whose size names keys) gives layouts that differ
in another way, or fails to run on the small shape; the tensor is then probed at its real size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

_SMALLEST = 32  # no dim is scaled below this many rows


def scalable_dims(shape: tuple[int, ...]) -> list[bool]:
    """The dims of `shape` a scaled probe divides: every dim of at least twice `_SMALLEST`,
    except dim 0 of a stack (3-D or more), whose size is the number of experts or layers, and
    names keys."""
    nd = len(shape)
    return [n >= 2 * _SMALLEST and not (d == 0 and nd >= 3) for d, n in enumerate(shape)]


def scale_factor(shapes: Iterable[tuple[int, ...]]) -> int:
    """The largest power of two that divides every scalable dim of `shapes` and leaves each at
    least `_SMALLEST`; 1 when none is scalable."""
    factor = None
    for shape in shapes:
        for n, scalable in zip(shape, scalable_dims(shape)):
            if scalable:
                f = n & -n  # the largest power of two dividing n
                while n // f < _SMALLEST:
                    f //= 2
                factor = f if factor is None else min(factor, f)
    return factor or 1


def scaled(shape: tuple[int, ...], f: int) -> tuple[int, ...]:
    """`shape` with its scalable dims divided by `f`."""
    return tuple(n // f if s else n for n, s in zip(shape, scalable_dims(shape)))


def grown(small: list[tuple], double: list[tuple], shape: tuple[int, ...], f: int):
    """The layout at `shape` from probes at `shape` / f (`small`) and / (f / 2) (`double`), or
    None when they do not differ by a factor of two on the scaled dims alone (see the module)."""
    if len(small) != len(double):
        return None
    model_scaled = scalable_dims(shape)
    layout = []
    for a, b in zip(small, double):
        # (key, offset, box, key shape[, corner in the key, key dim of each model dim]); a key
        # read as a view of itself (one dim split in two) is not scaled
        if a[0] != b[0] or len(a) != len(b) or len(a) not in (4, 6) or len(a[3]) != len(b[3]):
            return None
        key_scaled = [y == 2 * x for x, y in zip(a[3], b[3])]
        if any(y not in (x, 2 * x) for x, y in zip(a[3], b[3])):
            return None
        piece = [a[0]]
        for i, flags in ((1, model_scaled), (2, model_scaled), (3, key_scaled), (4, key_scaled)):
            if i == 4 and len(a) == 4:
                break
            if any(y != (2 * x if s else x) for x, y, s in zip(a[i], b[i], flags)):
                return None
            piece.append(tuple(x * f if s else x for x, s in zip(a[i], flags)))
        if len(a) == 6:
            if a[5] != b[5] or any(model_scaled[d] != key_scaled[k] for d, k in enumerate(a[5])):
                return None
            piece.append(a[5])
        layout.append(tuple(piece))
    inside = all(o + n <= s for _, offset, box, *_ in layout for o, n, s in zip(offset, box, shape))
    if not inside or sum(math.prod(box) for _, _, box, *_ in layout) != math.prod(shape):
        return None
    return layout
