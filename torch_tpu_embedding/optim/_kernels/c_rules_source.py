"""The C source of the fused eager row updates of :mod:`.c_rules` (RowWiseAdagrad, Adam / LazyAdam), of the
radix sort of the duplicate sum's keys (:func:`.row_sums.row_sums`), and of the lookup's prefetching row gather
and a stacked group's join of its features' ids (:mod:`.c_gather`).

Compiled into one library with SGD's add loop (:mod:`.c_library` builds, caches and loads it; this module holds
only the text). Each function takes a table's distinct touched ids, sorted, and where each id's gradient
contributions are (:class:`~.row_sums.RowSums`: ``offsets``, ``cols``, ``weights``, ``src``), and for each id
in turn sums its contributions (each ``weight · row`` rounded, then added in lookup order from 0, as
:meth:`.RowSums.rows` does) and applies the rule to its weight row and slot rows in place, the rows a few ids
ahead prefetched: the rows are scattered over a large table, and a random row is a cache (and TLB) miss. Each loop
prefetches at two distances: :data:`PREFETCH_FAR` ids ahead into the second-level cache, which takes more lines in
flight than the first, and :data:`PREFETCH_ROWS` ahead into the first (for writing, where the loop writes).

Each product and sum is rounded once, in the order of the rule's torch expression (``-ffp-contract=off``: no
FMA), so Adam's update is bitwise the rule's; RowWiseAdagrad's mean of ``g²`` over a row is summed in 16
lanes (torch's sum has its own vectorised order), within a rounding of the rule's (tests/optim/test_c_rules.py).
"""

from __future__ import annotations

__all__ = ["JOIN_IDS", "PREFETCH_FAR", "PREFETCH_ROWS", "SOURCE"]

#: distinct ids ahead whose rows are prefetched into the first-level cache (4, 8 and 16 measured alike on an AMD EPYC;
#: none 1.5× slower), here and in SGD's add loop (:mod:`.c_add_source`)
PREFETCH_ROWS = 8
#: distinct ids ahead whose rows are prefetched into the second-level cache, which takes more lines in flight than the
#: first, so more misses overlap: on an AMD EPYC the gather 9–15%, RowWiseAdagrad's loop 2–15% and Adam's 25–33%
#: faster (three arrays of rows in flight); 16, 32 and 64 alike (docs/benchmarks.md)
PREFETCH_FAR = 32
#: ids of one feature a stacked group's join handles at a time (4 KiB of int64), and the widest bag it takes
JOIN_IDS = 512

SOURCE = f"#define TTE_AHEAD {PREFETCH_ROWS}\n#define TTE_FAR {PREFETCH_FAR}\n#define TTE_JOIN_IDS {JOIN_IDS}\n" + r"""
#include <math.h>
#include <string.h>
/* The lines of bytes at ptr prefetched, for writing (rw 1) or reading (rw 0). */
#define TTE_PREFETCH(ptr, bytes, rw)                                                    \
  do {                                                                                  \
    const char *at_ = (const char *)(ptr);                                              \
    for (int64_t b_ = 0; b_ < (int64_t)(bytes); b_ += 64) __builtin_prefetch(at_ + b_, rw, 3); \
  } while (0)

/* The lines of bytes at ptr prefetched for reading into the second-level cache (locality 2: prefetcht1 on x86). */
#define TTE_PREFETCH_FAR(ptr, bytes)                                                    \
  do {                                                                                  \
    const char *at_ = (const char *)(ptr);                                              \
    for (int64_t b_ = 0; b_ < (int64_t)(bytes); b_ += 64) __builtin_prefetch(at_ + b_, 0, 2); \
  } while (0)

/* The gradient rows of the id TTE_AHEAD ahead of u (its first 4 contributions), prefetched for reading. */
#define TTE_PREFETCH_GRAD(u)                                                            \
  do {                                                                                  \
    const int64_t a_ = (u) + TTE_AHEAD;                                                  \
    if (!offsets) {                                                                     \
      TTE_PREFETCH(src + a_ * ss0, d * 4, 0);                                           \
    } else {                                                                            \
      const int64_t e_ = offsets[a_ + 1] < offsets[a_] + 4 ? offsets[a_ + 1] : offsets[a_] + 4; \
      for (int64_t k_ = offsets[a_]; k_ < e_; ++k_) TTE_PREFETCH(src + cols[k_] * ss0, d * 4, 0); \
    }                                                                                   \
  } while (0)

/* One id u's summed gradient row into g[d]: without offsets, row u of src; else the sum, from 0 and in order,
   of weights[k] * src[cols[k]] (weights NULL: src[cols[k]]) over k in [offsets[u], offsets[u + 1]). */
static inline void tte_sum_row(float *restrict g, int64_t d, int64_t u, const int64_t *restrict offsets,
                               const int64_t *restrict cols, const float *restrict weights,
                               const float *restrict src, int64_t ss0) {
  if (!offsets) {
    const float *restrict row = src + u * ss0;
    for (int64_t j = 0; j < d; ++j) g[j] = row[j];
    return;
  }
  for (int64_t j = 0; j < d; ++j) g[j] = 0.0f;
  for (int64_t k = offsets[u]; k < offsets[u + 1]; ++k) {
    const float *restrict row = src + cols[k] * ss0;
    if (weights) {
      const float wk = weights[k];
      for (int64_t j = 0; j < d; ++j) g[j] += wk * row[j];
    } else {
      for (int64_t j = 0; j < d; ++j) g[j] += row[j];
    }
  }
}

/* Every id a row of the table and above the one before it (distinct: a row updated twice, or by two threads at
   once, would be wrong), every contribution of theirs a row of src (srows rows). */
static int tte_ids_ok(const int64_t *restrict ids, int64_t n, int64_t rows, const int64_t *restrict offsets,
                      const int64_t *restrict cols, int64_t ncols, int64_t srows) {
  for (int64_t u = 0; u < n; ++u)
    if (ids[u] < 0 || ids[u] >= rows || (u > 0 && ids[u] <= ids[u - 1])) return 0;
  if (!offsets) return 1;
  if (offsets[0] < 0 || offsets[n] > ncols) return 0;
  for (int64_t u = 0; u < n; ++u)
    if (offsets[u + 1] < offsets[u]) return 0;
  for (int64_t k = offsets[0]; k < offsets[n]; ++k)
    if (cols[k] < 0 || cols[k] >= srows) return 0;
  return 1;
}

/* tte_ids_ok on its own: c_rules checks every thread's range (each from the last id of the range before it, so
   that the ids are ascending across ranges too) before any thread writes (each loop below checks only its own
   range before writing). */
int tte_rows_ok(const int64_t *restrict ids, int64_t n, int64_t rows, const int64_t *restrict offsets,
                const int64_t *restrict cols, int64_t ncols, int64_t srows) {
  return tte_ids_ok(ids, n, rows, offsets, cols, ncols, srows);
}

/* RowWiseAdagrad (rowwise_adagrad_rule) on ids[0:n], hp = {lr, eps, weight_decay}: g <- g + wd*w;
   m <- m + mean(g*g); w <- w - (lr*g) / (sqrt(m) + eps), the sum of g*g in 16 lanes over the whole blocks of 16,
   halved 8, 4, 2, 1, then the rest added in order. g: d floats of scratch. -1 (nothing written) if an id is
   outside [0, rows) or not above the one before it, or a contribution outside src's srows rows (cols has ncols
   entries). */
int tte_rowwise_adagrad_rows(float *restrict p, float *restrict acc, int64_t rows, int64_t d,
                             const int64_t *restrict ids, int64_t n, const int64_t *restrict offsets,
                             const int64_t *restrict cols, const float *restrict weights,
                             const float *restrict src, int64_t ss0, int64_t ncols, int64_t srows,
                             const float *restrict hp, float *restrict g) {
  if (!tte_ids_ok(ids, n, rows, offsets, cols, ncols, srows)) return -1;
  const float lr = hp[0], eps = hp[1], wd = hp[2];
  const int64_t full = d - d % 16;
  for (int64_t u = 0; u < n; ++u) {
    if (u + TTE_FAR < n) {
      const int64_t a = ids[u + TTE_FAR];
      TTE_PREFETCH_FAR(p + a * d, d * 4);
      __builtin_prefetch(acc + a, 0, 2);
    }
    if (u + TTE_AHEAD < n) {
      const int64_t a = ids[u + TTE_AHEAD];
      TTE_PREFETCH(p + a * d, d * 4, 1);
      __builtin_prefetch(acc + a, 1, 3);
      TTE_PREFETCH_GRAD(u);
    }
    const int64_t i = ids[u];
    float *restrict w = p + i * d;
    tte_sum_row(g, d, u, offsets, cols, weights, src, ss0);
    if (wd != 0.0f)
      for (int64_t j = 0; j < d; ++j) g[j] = g[j] + wd * w[j];
    float lane[16] = {0};
    for (int64_t j = 0; j < full; j += 16)
      for (int q = 0; q < 16; ++q) lane[q] += g[j + q] * g[j + q];
    for (int q = 0; q < 8; ++q) lane[q] += lane[q + 8];
    for (int q = 0; q < 4; ++q) lane[q] += lane[q + 4];
    for (int q = 0; q < 2; ++q) lane[q] += lane[q + 2];
    float sum = lane[0] + lane[1];
    for (int64_t j = full; j < d; ++j) sum += g[j] * g[j];
    const float m = acc[i] + sum / (float)d;
    acc[i] = m;
    const float denom = sqrtf(m) + eps;
    for (int64_t j = 0; j < d; ++j) w[j] = w[j] - (lr * g[j]) / denom;
  }
  return 0;
}

/* Adam (adam_rule) on ids[0:n], hp = {lr_t, b1, 1-b1, b2, 1-b2, eps (or eps*eps), inside}: m <- b1*m + (1-b1)*g;
   v <- b2*v + ((1-b2)*g)*g; w <- w - (lr_t*m) / sqrt(v + eps*eps) (inside != 0) or / (sqrt(v) + eps). lr_t is
   the bias-corrected rate where the rule corrects it (computed by the caller with the rule's torch ops). */
int tte_adam_rows(float *restrict p, float *restrict mom, float *restrict vel, int64_t rows, int64_t d,
                  const int64_t *restrict ids, int64_t n, const int64_t *restrict offsets,
                  const int64_t *restrict cols, const float *restrict weights, const float *restrict src,
                  int64_t ss0, int64_t ncols, int64_t srows, const float *restrict hp, float *restrict g) {
  if (!tte_ids_ok(ids, n, rows, offsets, cols, ncols, srows)) return -1;
  const float lr = hp[0], b1 = hp[1], c1 = hp[2], b2 = hp[3], c2 = hp[4], eps = hp[5];
  const int inside = hp[6] != 0.0f;
  for (int64_t u = 0; u < n; ++u) {
    if (u + TTE_FAR < n) {
      const int64_t a = ids[u + TTE_FAR];
      TTE_PREFETCH_FAR(p + a * d, d * 4);
      TTE_PREFETCH_FAR(mom + a * d, d * 4);
      TTE_PREFETCH_FAR(vel + a * d, d * 4);
    }
    if (u + TTE_AHEAD < n) {
      const int64_t a = ids[u + TTE_AHEAD];
      TTE_PREFETCH(p + a * d, d * 4, 1);
      TTE_PREFETCH(mom + a * d, d * 4, 1);
      TTE_PREFETCH(vel + a * d, d * 4, 1);
      TTE_PREFETCH_GRAD(u);
    }
    const int64_t i = ids[u];
    float *restrict w = p + i * d, *restrict m = mom + i * d, *restrict v = vel + i * d;
    tte_sum_row(g, d, u, offsets, cols, weights, src, ss0);
    if (inside) {
      for (int64_t j = 0; j < d; ++j) {
        const float mj = b1 * m[j] + c1 * g[j], vj = b2 * v[j] + (c2 * g[j]) * g[j];
        m[j] = mj;
        v[j] = vj;
        w[j] = w[j] - (lr * mj) / sqrtf(vj + eps);
      }
    } else {
      for (int64_t j = 0; j < d; ++j) {
        const float mj = b1 * m[j] + c1 * g[j], vj = b2 * v[j] + (c2 * g[j]) * g[j];
        m[j] = mj;
        v[j] = vj;
        w[j] = w[j] - (lr * mj) / (sqrtf(vj) + eps);
      }
    }
  }
  return 0;
}

/* out[k] = table row ids[k] for k in [0, n), rows of row_bytes bytes (any dtype: a copy), the rows TTE_FAR ids
   ahead (into the second-level cache) and TTE_AHEAD ids ahead (into the first) prefetched for reading. -1 (nothing
   written) if an id is outside [0, rows). */
int tte_gather_rows(char *restrict out, const char *restrict p, int64_t rows, int64_t row_bytes,
                    const int64_t *restrict ids, int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    if (ids[k] < 0 || ids[k] >= rows) return -1;
  for (int64_t k = 0; k < n; ++k) {
    if (k + TTE_FAR < n) TTE_PREFETCH_FAR(p + ids[k + TTE_FAR] * row_bytes, row_bytes);
    if (k + TTE_AHEAD < n) TTE_PREFETCH(p + ids[k + TTE_AHEAD] * row_bytes, row_bytes, 0);
    memcpy(out + k * row_bytes, p + ids[k] * row_bytes, (size_t)row_bytes);
  }
  return 0;
}

/* keys[0:n] (each >= 0 and < 2^bits, bits <= 66) sorted by their bits [low, bits) in place, stably: LSD radix sort,
   11-bit digits from bit low up, every digit's counts taken in one pass over the keys; tmp: n int64 of scratch. */
static void tte_radix_sort(int64_t *restrict keys, int64_t *restrict tmp, int64_t n, int64_t low, int64_t bits) {
  const int64_t passes = bits > low ? (bits - low + 10) / 11 : 0;
  int64_t count[6][2048];
  for (int64_t q = 0; q < passes; ++q)
    for (int k = 0; k < 2048; ++k) count[q][k] = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t q = 0; q < passes; ++q) count[q][(keys[i] >> (low + 11 * q)) & 2047]++;
  int64_t *from = keys, *to = tmp;
  for (int64_t q = 0; q < passes; ++q) {
    const int64_t shift = low + 11 * q;
    int64_t sum = 0;
    for (int k = 0; k < 2048; ++k) {
      const int64_t c = count[q][k];
      count[q][k] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < n; ++i) to[count[q][(from[i] >> shift) & 2047]++] = from[i];
    int64_t *swap = from;
    from = to;
    to = swap;
  }
  if (from != keys)
    for (int64_t i = 0; i < n; ++i) keys[i] = from[i];
}

/* The duplicate sum's keys (row_sums: id * n + position, all >= 0 and < 2^bits, distinct) sorted ascending in
   place; tmp: n int64 of scratch. */
void tte_sort_keys(int64_t *restrict keys, int64_t *restrict tmp, int64_t n, int64_t bits) {
  tte_radix_sort(keys, tmp, n, 0, bits);
}

/* ids[0:n] (each in [0, 2^(bits - shift))) grouped in the order of (id, position): the keys (id << shift) | k
   (n <= 2^shift) radix-sorted (keys, tmp: n int64 of scratch) by their id bits alone (made in position order, and
   the sort is stable: ties stay in position order, so the keys come out fully sorted with half the passes over
   them at 20 ids), then in one pass the distinct ids in ascending
   order into uniq, where each one's run starts into offsets (offsets[U] = n), each position k into perm, and,
   with cols, perm / width into cols. Returns U, the number of distinct ids. */
int64_t tte_group_ids(const int64_t *restrict ids, int64_t n, int64_t shift, int64_t bits, int64_t width,
                      int64_t *restrict keys, int64_t *restrict tmp, int64_t *restrict uniq,
                      int64_t *restrict offsets, int64_t *restrict perm, int64_t *restrict cols) {
  for (int64_t k = 0; k < n; ++k) keys[k] = (ids[k] << shift) | k;
  tte_radix_sort(keys, tmp, n, shift, bits);
  const int64_t mask = ((int64_t)1 << shift) - 1;
  int64_t u = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t id = keys[k] >> shift, at = keys[k] & mask;
    if (k == 0 || id != uniq[u - 1]) {
      uniq[u] = id;
      offsets[u] = k;
      ++u;
    }
    perm[k] = at;
    if (cols) cols[k] = at / width;
  }
  offsets[u] = n;
  return u;
}

/* A stacked group's features' ids side by side, shifted to their tables' rows, for the bags [b0, b1): out[b][f][l]
   = src[f][b * width + l] + shift[f] for b0 <= b < b1, f < nf, l < width, int64 or (narrow) int32; where keep is
   given (one bool array per feature), an id whose keep[f][b * width + l] is 0 is written as sentinel instead and not
   checked. Each id kept (before its shift) is checked to lie in [0, vocab[f]): -1 (out not written in full) at the
   first block of bags of a feature holding one that does not. */
/* One id: x shifted by s, or (masked out: on all zeros) the sentinel; bad gains a kept id outside [0, v). */
#define TTE_JOIN_ONE(T, x, on, dst)                                                                      \
  do {                                                                                                  \
    bad |= (on) & (uint64_t)((x) >= v); /* (a negative id is a large unsigned one) */                  \
    dst = (T)(((on) & ((x) + s)) | (~(on) & (uint64_t)sentinel));                                       \
  } while (0)
#define TTE_JOIN_LOOP(T, buf)                                                                               \
  for (int64_t bb = b0; bb < b1; bb += block) {                                                         \
    const int64_t be = b1 - bb < block ? b1 : bb + block, n = (be - bb) * width;                        \
    for (int64_t f = 0; f < nf; ++f) {                                                                  \
      const int64_t *restrict from = src[f] + bb * width;                                               \
      const unsigned char *restrict k = keep ? keep[f] + bb * width : NULL;                             \
      const uint64_t s = (uint64_t)shift[f], v = (uint64_t)vocab[f];                                    \
      T *restrict to = (T *)out + (bb * nf + f) * width;                                                \
      uint64_t bad = 0;                                                                                 \
      if (width >= 16) { /* wide bags: straight to their place, a vector loop per bag */                \
        for (int64_t b = 0; b < be - bb; ++b) {                                                         \
          const int64_t *restrict x = from + b * width;                                                 \
          T *restrict y = to + b * nf * width;                                                          \
          if (k) {                                                                                      \
            const unsigned char *restrict kb = k + b * width;                                           \
            for (int64_t l = 0; l < width; ++l)                                                         \
              TTE_JOIN_ONE(T, (uint64_t)x[l], -(uint64_t)(kb[l] != 0), y[l]);                           \
          } else {                                                                                      \
            for (int64_t l = 0; l < width; ++l) TTE_JOIN_ONE(T, (uint64_t)x[l], ~(uint64_t)0, y[l]);    \
          }                                                                                             \
        }                                                                                               \
      } else { /* narrow bags: the block in one vector loop into a buffer, then bag by bag */           \
        T *restrict tmp = buf;                                                                          \
        if (k) {                                                                                        \
          for (int64_t i = 0; i < n; ++i) TTE_JOIN_ONE(T, (uint64_t)from[i], -(uint64_t)(k[i] != 0), tmp[i]); \
        } else {                                                                                        \
          for (int64_t i = 0; i < n; ++i) TTE_JOIN_ONE(T, (uint64_t)from[i], ~(uint64_t)0, tmp[i]);     \
        }                                                                                               \
        for (int64_t b = 0; b < be - bb; ++b)                                                           \
          for (int64_t l = 0; l < width; ++l) to[b * nf * width + l] = tmp[b * width + l];              \
      }                                                                                                 \
      if (bad) return -1;                                                                               \
    }                                                                                                   \
  }
int tte_join_ids(void *restrict out, int narrow, const int64_t *const *restrict src,
                 const unsigned char *const *restrict keep, const int64_t *restrict shift,
                 const int64_t *restrict vocab, int64_t sentinel, int64_t nf, int64_t b0, int64_t b1, int64_t width) {
  /* A block of bags at a time, feature by feature: each feature's block (TTE_JOIN_IDS ids, contiguous) is checked,
     shifted and padded in one vectorised loop into a buffer, then written bag by bag; its ids are read in runs (one
     stream the prefetcher follows) and the block's output stays in cache. Bag by bag, every feature read at once
     was one cache miss per 64 bytes of ids at 100 features. width <= TTE_JOIN_IDS (the caller's check). */
  int64_t wide[TTE_JOIN_IDS];
  int32_t narrowed[TTE_JOIN_IDS];
  const int64_t block = width >= 16 && nf <= 8 ? 1 : TTE_JOIN_IDS / width;
  if (narrow) {
    TTE_JOIN_LOOP(int32_t, narrowed)
  } else {
    TTE_JOIN_LOOP(int64_t, wide)
  }
  return 0;
}
"""
