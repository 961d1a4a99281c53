// Per-row statistics of a block of logits, in two passes over each row and no temporaries (see row_stats.py).
//
// For every row z of logits [rows, d_vocab] and its reference token k (the final distribution's top-1):
//   at_ref    = z[k]
//   runner_up = max over v != k of z[v]            (-inf when d_vocab == 1)
//   mass      = sum_v exp(z[v] - peak)             with peak = max(at_ref, runner_up), so mass >= 1
//   weighted  = sum_v exp(z[v] - peak) (z[v] - peak)
//   agree     = whether argmax(z) == k, the first maximum as torch.argmax takes it
// NaN propagates into the sums as it does through torch's ops; the caller checks and takes its slow path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
const float kInf = std::numeric_limits<float>::infinity();

float nan_max(float a, float b) { return (std::isnan(a) || std::isnan(b)) ? NAN : (a > b ? a : b); }

float lanes_max(const Vec& v) {
  float buf[kLanes];
  v.store(buf);
  float m = buf[0];
  for (int64_t i = 1; i < kLanes; ++i) m = nan_max(m, buf[i]);
  return m;
}

float lanes_sum(const Vec& v) {
  float buf[kLanes];
  v.store(buf);
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += buf[i];
  return s;
}

// max over the row (NaN-propagating, as torch.amax); a short last piece is padded with -inf
float row_max(const float* row, int64_t n) {
  Vec m(-kInf);
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) m = at::vec::maximum(m, Vec::loadu(row + v));
  if (v < n) m = at::vec::maximum(m, Vec::set(Vec(-kInf), Vec::loadu(row + v, n - v), n - v));
  return lanes_max(m);
}

void one_row(float* row, int64_t n, int64_t k, float* at_ref, float* runner_up, float* mass, float* weighted,
             bool* agree) {
  const float at = row[k];
  row[k] = -kInf;  // the largest of the others in one pass, then put back
  const float runner = row_max(row, n);
  row[k] = at;
  const float peak = nan_max(at, runner);
  Vec s(0.f), w(0.f);
  const Vec shift(peak);
  int64_t v = 0;
  for (; v + kLanes <= n; v += kLanes) {
    const Vec y = Vec::loadu(row + v) - shift;
    const Vec e = y.exp();
    s = s + e;
    w = at::vec::fmadd(e, y, w);
  }
  if (v < n) {  // the last piece: lanes past the row's end add nothing
    const Vec y = Vec::loadu(row + v, n - v) - shift;
    const Vec e = y.exp();
    s = s + Vec::set(Vec(0.f), e, n - v);
    w = w + Vec::set(Vec(0.f), e * y, n - v);
  }
  bool first = at > runner;
  if (at == runner) {  // a tie for the maximum: argmax takes the first of the tied tokens
    first = true;
    for (int64_t u = 0; u < k; ++u) {
      if (row[u] == at) {
        first = false;
        break;
      }
    }
  }
  *at_ref = at;
  *runner_up = runner;
  *mass = lanes_sum(s);
  *weighted = lanes_sum(w);
  *agree = first;
}

}  // namespace

void row_stats(torch::Tensor z, torch::Tensor ref, torch::Tensor at_ref, torch::Tensor runner_up, torch::Tensor mass,
               torch::Tensor weighted, torch::Tensor agree) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.is_contiguous() && z.device().is_cpu(),
              "row_stats: z must be a contiguous float32 CPU tensor [rows, d_vocab]");
  const int64_t rows = z.size(0), n = z.size(1);
  TORCH_CHECK(n > 0, "row_stats: empty rows");
  TORCH_CHECK(ref.scalar_type() == at::kLong && ref.is_contiguous() && ref.numel() == rows,
              "row_stats: ref must be a contiguous int64 tensor [rows]");
  for (const auto& t : {at_ref, runner_up, mass, weighted}) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == rows,
                "row_stats: outputs must be contiguous float32 tensors [rows]");
  }
  TORCH_CHECK(agree.scalar_type() == at::kBool && agree.is_contiguous() && agree.numel() == rows,
              "row_stats: agree must be a contiguous bool tensor [rows]");
  const int64_t* ids = ref.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ids[r] >= 0 && ids[r] < n, "row_stats: reference token ", ids[r], " outside 0..", n - 1);
  }
  float* zp = z.data_ptr<float>();
  float *a = at_ref.data_ptr<float>(), *b = runner_up.data_ptr<float>();
  float *s = mass.data_ptr<float>(), *w = weighted.data_ptr<float>();
  bool* g = agree.data_ptr<bool>();
  // With -fopenmp, at::parallel_for runs on torch's own OpenMP threads: the loader resolves this module's
  // libgomp.so.1 to the copy torch has already loaded, so torch.set_num_threads applies here too.
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) one_row(zp + r * n, n, ids[r], a + r, b + r, s + r, w + r, g + r);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_stats", &row_stats, "per-row logit statistics (row_stats.py)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
