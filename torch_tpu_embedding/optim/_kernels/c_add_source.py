"""The C source of SGD's add loop, ``tte_add_rows`` (:mod:`.c_add` calls it): the text alone.

:mod:`.c_library` compiles it into one library with :mod:`.c_rules_source`'s loops, and :func:`.c_add.add_piece`
checks everything the loop is handed (it trusts its pointers).
"""

from __future__ import annotations

# (the prefetch distances of every loop of the library, defined once)
from torch_tpu_embedding.optim._kernels.c_rules_source import PREFETCH_FAR, PREFETCH_ROWS

__all__ = ["SOURCE"]

SOURCE = r"""
#include <stdint.h>
/* For each bag b in [0, nbags) and each of its width ids, in order: p[id] += gain * (f * g[b]), where gain is
   gains[b * width + l] (without gains: p[id] += f * g[b]); ids == rows (padding, the sentinel) are skipped.
   inc: d floats of scratch. -1 (nothing written) if an id is outside [0, rows]. */
int tte_add_rows(float *restrict p, int64_t rows, int64_t d, const int64_t *restrict ids, int64_t nbags,
                 int64_t width, const float *restrict g, int64_t gs0, int64_t gs1, const float *restrict gains,
                 const float *restrict factor, float *restrict inc) {
  const int64_t n = nbags * width;
  for (int64_t k = 0; k < n; ++k)
    if (ids[k] < 0 || ids[k] > rows) return -1;
  const float f = *factor;
  for (int64_t b = 0; b < nbags; ++b) {
    const float *gb = g + b * gs0;
    for (int64_t j = 0; j < d; ++j) inc[j] = f * gb[j * gs1];
    for (int64_t k = b * width; k < (b + 1) * width; ++k) {
      if (k + %(far)d < n && ids[k + %(far)d] < rows) {
        const char *far = (const char *)(p + ids[k + %(far)d] * d);
        for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64) __builtin_prefetch(far + c, 0, 2);
      }
      if (k + %(ahead)d < n && ids[k + %(ahead)d] < rows) {
        const char *next = (const char *)(p + ids[k + %(ahead)d] * d);
        for (int64_t c = 0; c < d * (int64_t)sizeof(float); c += 64) __builtin_prefetch(next + c, 1, 3);
      }
      if (ids[k] == rows) continue;
      float *row = p + ids[k] * d;
      if (gains) {
        const float gain = gains[k];
        for (int64_t j = 0; j < d; ++j) row[j] += gain * inc[j];
      } else {
        for (int64_t j = 0; j < d; ++j) row[j] += inc[j];
      }
    }
  }
  return 0;
}
""" % {"ahead": PREFETCH_ROWS, "far": PREFETCH_FAR}
