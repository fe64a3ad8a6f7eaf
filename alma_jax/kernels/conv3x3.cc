// A 3x3 'SAME' convolution, stride 1, NHWC input, HWIO kernel, float32, and its weight
// gradient, as XLA FFI custom calls for XLA:CPU (alma_jax/kernels/native.py builds and
// registers them; the input gradient is the forward convolution of dy with the kernel
// flipped and transposed):
//
//   y[n, h, w, co] = sum over kh, kw, ci of x[n, h + kh - 1, w + kw - 1, ci] * k[kh, kw, ci, co]
//   dw[kh, kw, ci, co] = sum over n, h, w of x[n, h + kh - 1, w + kw - 1, ci] * dy[n, h, w, co]
//
// (taps that fall outside the image read zeros).
//
// The forward convolution copies each image into a zero-padded buffer; for each output row,
// run of up to kMaxRun pixels and block of output channels it keeps one vector accumulator
// per pixel in registers while it walks the 9 x CI kernel rows: per kernel row one load of
// the kernel's channels and one broadcast multiply-add per pixel. Images are shared among
// the intra-op threads; each output element is one thread's, summed in a fixed order.
//
// The weight gradient: for each image, kernel tap and block of output channels, a block of
// up to kMaxRows input channels keeps one vector accumulator per input channel in registers
// while it walks the image's pixels: per pixel one load of dy's channels and one broadcast
// multiply-add per input channel. The image (x and dy) stays in
// the cache across the nine taps. Blocks of images are shared among XLA:CPU's intra-op
// threads, each block summing into a buffer of its own; the buffers are added at the end, in
// an order that does not depend on the threads (the result is the same from run to run).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kMaxRows = 16;  // 16 accumulators of 16 floats: half of AVX-512's registers
#else
constexpr int kMaxRows = 6;  // a 16-float vector is two registers without AVX-512
#endif
// The images are summed in blocks of at least this many multiply-adds (a call with less work
// is one block, on the calling thread), and at most kMaxBlocks blocks.
constexpr int64_t kBlockWork = int64_t{1} << 22;
constexpr int64_t kMaxBlocks = 8;

template <int L>
struct Vec {
  typedef float type __attribute__((vector_size(L * sizeof(float))));
};
template <>
struct Vec<1> {
  typedef float type;
};

template <int L>
inline typename Vec<L>::type Load(const float* p) {
  typename Vec<L>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int L>
inline void AddTo(float* p, typename Vec<L>::type v) {
  typename Vec<L>::type u;
  std::memcpy(&u, p, sizeof(u));
  u += v;
  std::memcpy(p, &u, sizeof(u));
}

struct Shape {
  int64_t n, h, w, ci, co;
};

// Runs fn(0), ..., fn(count - 1) on the calling thread and on up to `helpers` tasks of
// XLA:CPU's intra-op pool, which claim indices in turn. A task that starts after every index
// was claimed touches nothing but the counters, and the caller waits only for tasks that
// claimed an index, so it never waits for a task the pool has not started.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, int helpers, const F& fn) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int> in_flight{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, count, fn] {
    counters->in_flight.fetch_add(1);
    for (int64_t i = counters->next.fetch_add(1); i < count; i = counters->next.fetch_add(1))
      fn(i);
    counters->in_flight.fetch_sub(1);
  };
  for (int t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  while (counters->in_flight.load() != 0) std::this_thread::yield();
}

// acc[tap][ci0 .. ci0 + R)[co0 .. co0 + L) += the tap's products over one image.
template <int R, int L>
void TapBlock(const float* x, const float* dy, float* acc, const Shape& s, int kh, int kw,
              int64_t ci0, int64_t co0) {
  using V = typename Vec<L>::type;
  const int64_t h_lo = std::max<int64_t>(0, 1 - kh), h_hi = std::min<int64_t>(s.h, s.h + 1 - kh);
  const int64_t w_lo = std::max<int64_t>(0, 1 - kw), w_hi = std::min<int64_t>(s.w, s.w + 1 - kw);
  V sums[R];
  for (int r = 0; r < R; ++r) sums[r] = V{} + 0.0f;
  for (int64_t h = h_lo; h < h_hi; ++h) {
    const float* xp = x + ((h + kh - 1) * s.w + (w_lo + kw - 1)) * s.ci + ci0;
    const float* gp = dy + (h * s.w + w_lo) * s.co + co0;
    for (int64_t w = w_lo; w < w_hi; ++w, xp += s.ci, gp += s.co) {
      const V g = Load<L>(gp);
      for (int r = 0; r < R; ++r) sums[r] += xp[r] * g;
    }
  }
  float* out = acc + ((kh * 3 + kw) * s.ci + ci0) * s.co + co0;
  for (int r = 0; r < R; ++r) AddTo<L>(out + r * s.co, sums[r]);
}

template <int L>
void Rows(int rows, const float* x, const float* dy, float* acc, const Shape& s, int kh, int kw,
          int64_t ci0, int64_t co0) {
  switch (rows) {
#define ALMA_ROWS_CASE(R) \
  case R:                 \
    return TapBlock<R, L>(x, dy, acc, s, kh, kw, ci0, co0);
    ALMA_ROWS_CASE(1)
    ALMA_ROWS_CASE(2)
    ALMA_ROWS_CASE(3)
    ALMA_ROWS_CASE(4)
    ALMA_ROWS_CASE(5)
    ALMA_ROWS_CASE(6)
#if defined(__AVX512F__)
    ALMA_ROWS_CASE(7)
    ALMA_ROWS_CASE(8)
    ALMA_ROWS_CASE(9)
    ALMA_ROWS_CASE(10)
    ALMA_ROWS_CASE(11)
    ALMA_ROWS_CASE(12)
    ALMA_ROWS_CASE(13)
    ALMA_ROWS_CASE(14)
    ALMA_ROWS_CASE(15)
    ALMA_ROWS_CASE(16)
#endif
#undef ALMA_ROWS_CASE
  }
}

// Adds image `i`'s contribution to acc (9 * ci * co floats, HWIO order).
void Image(const float* x, const float* dy, float* acc, const Shape& s, int64_t i) {
  x += i * s.h * s.w * s.ci;
  dy += i * s.h * s.w * s.co;
  for (int kh = 0; kh < 3; ++kh) {
    for (int kw = 0; kw < 3; ++kw) {
      int64_t co0 = 0;
      // Output channels in vectors of 16, then 8, 4 and single lanes.
      for (; co0 + 16 <= s.co; co0 += 16)
        for (int64_t c = 0; c < s.ci; c += kMaxRows)
          Rows<16>(static_cast<int>(std::min<int64_t>(kMaxRows, s.ci - c)), x, dy, acc, s, kh, kw,
                   c, co0);
      for (; co0 + 8 <= s.co; co0 += 8)
        for (int64_t c = 0; c < s.ci; c += kMaxRows)
          Rows<8>(static_cast<int>(std::min<int64_t>(kMaxRows, s.ci - c)), x, dy, acc, s, kh, kw,
                  c, co0);
      for (; co0 + 4 <= s.co; co0 += 4)
        for (int64_t c = 0; c < s.ci; c += 6)
          Rows<4>(static_cast<int>(std::min<int64_t>(6, s.ci - c)), x, dy, acc, s, kh, kw, c,
                  co0);
      for (; co0 < s.co; ++co0)
        for (int64_t c = 0; c < s.ci; c += 6)
          Rows<1>(static_cast<int>(std::min<int64_t>(6, s.ci - c)), x, dy, acc, s, kh, kw, c,
                  co0);
    }
  }
}

// The images are cut into `blocks` runs of consecutive images, a number that depends on the
// shapes only; each block sums its images in order into a buffer of its own, and the buffers
// are added in order: the result does not depend on which thread ran which block.
ffi::Error Wgrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                 ffi::ResultBuffer<ffi::F32> dw) {
  const auto xd = x.dimensions(), gd = dy.dimensions(), wd = dw->dimensions();
  if (xd.size() != 4 || gd.size() != 4 || wd.size() != 4)
    return ffi::Error::InvalidArgument("conv3x3_wgrad: x, dy and dw must be rank 4");
  const Shape s{xd[0], xd[1], xd[2], xd[3], gd[3]};
  if (gd[0] != s.n || gd[1] != s.h || gd[2] != s.w || wd[0] != 3 || wd[1] != 3 ||
      wd[2] != s.ci || wd[3] != s.co)
    return ffi::Error::InvalidArgument(
        "conv3x3_wgrad: expected x (N, H, W, CI), dy (N, H, W, CO), dw (3, 3, CI, CO)");
  float* out = dw->typed_data();
  const int64_t size = 9 * s.ci * s.co;
  const int64_t work = s.n * s.h * s.w * size;
  const int blocks = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({work / kBlockWork, s.n, kMaxBlocks})));
  std::vector<std::vector<float>> buffers(blocks, std::vector<float>(size, 0.0f));
  const float* xs = x.typed_data();
  const float* gs = dy.typed_data();
  ParallelFor(pool, blocks, static_cast<int>(std::min<int64_t>(pool.num_threads(), blocks - 1)),
              [&](int64_t b) {
                for (int64_t i = s.n * b / blocks; i < s.n * (b + 1) / blocks; ++i)
                  Image(xs, gs, buffers[b].data(), s, i);
              });
  std::memcpy(out, buffers[0].data(), size * sizeof(float));
  for (int b = 1; b < blocks; ++b)
    for (int64_t j = 0; j < size; ++j) out[j] += buffers[b][j];
  return ffi::Error::Success();
}


// ---- The forward convolution ------------------------------------------------------------------

#if defined(__AVX512F__)
constexpr int kMaxRun = 16;  // 16 accumulators of 16 floats
#else
constexpr int kMaxRun = 6;
#endif

// y[row, w0 .. w0 + P)[co0 .. co0 + L) of one image from its padded copy xp ((h + 2) x (w + 2)
// x ci).
template <int P, int L>
void RunBlock(const float* xp, const float* k, float* y, const Shape& s, int64_t h, int64_t w0,
              int64_t co0) {
  using V = typename Vec<L>::type;
  V sums[P];
  for (int p = 0; p < P; ++p) sums[p] = V{} + 0.0f;
  const int64_t row = (s.w + 2) * s.ci;
  for (int kh = 0; kh < 3; ++kh) {
    for (int kw = 0; kw < 3; ++kw) {
      const float* xs = xp + (h + kh) * row + (w0 + kw) * s.ci;
      const float* ks = k + (kh * 3 + kw) * s.ci * s.co + co0;
      for (int64_t c = 0; c < s.ci; ++c, ks += s.co) {
        const V kv = Load<L>(ks);
        for (int p = 0; p < P; ++p) sums[p] += xs[p * s.ci + c] * kv;
      }
    }
  }
  float* out = y + (h * s.w + w0) * s.co + co0;
  for (int p = 0; p < P; ++p) std::memcpy(out + p * s.co, &sums[p], sizeof(V));
}

template <int L>
void Run(int run, const float* xp, const float* k, float* y, const Shape& s, int64_t h,
         int64_t w0, int64_t co0) {
  switch (run) {
#define ALMA_RUN_CASE(P) \
  case P:                \
    return RunBlock<P, L>(xp, k, y, s, h, w0, co0);
    ALMA_RUN_CASE(1)
    ALMA_RUN_CASE(2)
    ALMA_RUN_CASE(3)
    ALMA_RUN_CASE(4)
    ALMA_RUN_CASE(5)
    ALMA_RUN_CASE(6)
#if defined(__AVX512F__)
    ALMA_RUN_CASE(7)
    ALMA_RUN_CASE(8)
    ALMA_RUN_CASE(9)
    ALMA_RUN_CASE(10)
    ALMA_RUN_CASE(11)
    ALMA_RUN_CASE(12)
    ALMA_RUN_CASE(13)
    ALMA_RUN_CASE(14)
    ALMA_RUN_CASE(15)
    ALMA_RUN_CASE(16)
#endif
#undef ALMA_RUN_CASE
  }
}

template <int L>
void Runs(int max_run, const float* xp, const float* k, float* y, const Shape& s, int64_t h,
          int64_t co0) {
  for (int64_t w0 = 0; w0 < s.w; w0 += max_run)
    Run<L>(static_cast<int>(std::min<int64_t>(max_run, s.w - w0)), xp, k, y, s, h, w0, co0);
}

// Image `i` of y from image `i` of x; `xp`: scratch for its padded copy.
void ForwardImage(const float* x, const float* k, float* y, const Shape& s, int64_t i,
                  std::vector<float>& xp) {
  x += i * s.h * s.w * s.ci;
  y += i * s.h * s.w * s.co;
  const int64_t row = (s.w + 2) * s.ci;
  xp.assign((s.h + 2) * row, 0.0f);
  for (int64_t h = 0; h < s.h; ++h)
    std::memcpy(xp.data() + (h + 1) * row + s.ci, x + h * s.w * s.ci, s.w * s.ci * sizeof(float));
  for (int64_t h = 0; h < s.h; ++h) {
    int64_t co0 = 0;
    for (; co0 + 16 <= s.co; co0 += 16) Runs<16>(kMaxRun, xp.data(), k, y, s, h, co0);
    for (; co0 + 8 <= s.co; co0 += 8) Runs<8>(kMaxRun, xp.data(), k, y, s, h, co0);
    for (; co0 + 4 <= s.co; co0 += 4) Runs<4>(6, xp.data(), k, y, s, h, co0);
    for (; co0 < s.co; ++co0) Runs<1>(6, xp.data(), k, y, s, h, co0);
  }
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> k,
                   ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), kd = k.dimensions(), yd = y->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4)
    return ffi::Error::InvalidArgument("conv3x3_forward: x, k and y must be rank 4");
  const Shape s{xd[0], xd[1], xd[2], xd[3], kd[3]};
  if (kd[0] != 3 || kd[1] != 3 || kd[2] != s.ci || yd[0] != s.n || yd[1] != s.h ||
      yd[2] != s.w || yd[3] != s.co)
    return ffi::Error::InvalidArgument(
        "conv3x3_forward: expected x (N, H, W, CI), k (3, 3, CI, CO), y (N, H, W, CO)");
  // Which thread computes an image does not change its values: images are claimed freely.
  const int64_t work = s.n * s.h * s.w * 9 * s.ci * s.co;
  const int helpers = work < kBlockWork || s.n < 2
                          ? 0
                          : static_cast<int>(std::min<int64_t>(pool.num_threads(), s.n - 1));
  const float* xs = x.typed_data();
  const float* ks = k.typed_data();
  float* ys = y->typed_data();
  ParallelFor(pool, s.n, helpers, [&](int64_t i) {
    thread_local std::vector<float> padded;  // the image's zero-padded copy
    ForwardImage(xs, ks, ys, s, i, padded);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AlmaConv3x3Forward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AlmaConv3x3Wgrad, Wgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
