// Scalar reference implementations of the codecs and of the compressed allreduce, written
// straight from the definitions (codec_kernels.hpp, and the algorithm of 1-bit Adam as docs/comm.md
// states it), with no SIMD, no threads and no cleverness. Tests compare the real code against these
// bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace ref {

inline uint64_t onebit_padded(uint64_t numel, uint64_t n) {
  const uint64_t unit = n * std::lcm(n, uint64_t{8});
  return (numel + unit - 1) / unit * unit;
}

inline float onebit_scale(const std::vector<float>& b) {
  // Blocks of 2048, 16 lanes, pairwise fold, double over superblocks of 256 blocks.
  const size_t n = b.size();
  std::vector<float> partial;
  for (size_t at = 0; at < n; at += 2048) {
    float lanes[16] = {};
    for (size_t k = 0; k < 2048 && at + k < n; ++k) {
      const float v = b[at + k];
      const float sq = v * v;
      lanes[k % 16] = lanes[k % 16] + sq;
    }
    for (size_t step = 8; step >= 1; step /= 2) {
      for (size_t i = 0; i < step; ++i) lanes[i] = lanes[i] + lanes[i + step];
    }
    partial.push_back(lanes[0]);
  }
  double total = 0.0;
  for (size_t s = 0; s < partial.size(); s += 256) {
    double super = 0.0;
    for (size_t i = s; i < std::min(partial.size(), s + 256); ++i) super += partial[i];
    total += super;
  }
  return n == 0 ? 0.0f : static_cast<float>(std::sqrt(total / static_cast<double>(n)));
}

// Encodes x (+ e when e is not empty) into `chunks` chunks: [fp32 scale][c/8 bytes]...
inline std::vector<uint8_t> onebit_encode(const std::vector<float>& x, std::vector<float>* e,
                                          size_t chunks) {
  const size_t n = x.size();
  std::vector<float> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = e != nullptr ? x[i] + (*e)[i] : x[i];
  const float s = onebit_scale(b);
  const size_t c = n / chunks;
  const size_t cb = 4 + c / 8;
  std::vector<uint8_t> out(chunks * cb, 0);
  for (size_t j = 0; j < chunks; ++j) {
    std::memcpy(out.data() + j * cb, &s, 4);
    for (size_t k = 0; k < c; ++k) {
      const size_t i = j * c + k;
      const bool bit = b[i] >= 0.0f;
      if (bit)
        out[j * cb + 4 + k / 8] =
            static_cast<uint8_t>(out[j * cb + 4 + k / 8] | (0x80u >> (k % 8)));
      if (e != nullptr) (*e)[i] = b[i] - (bit ? s : -s);
    }
  }
  return out;
}

inline void onebit_decode(const uint8_t* in, size_t chunks, size_t c, float alpha, bool acc,
                          float* out) {
  const size_t cb = 4 + c / 8;
  for (size_t j = 0; j < chunks; ++j) {
    float s;
    std::memcpy(&s, in + j * cb, 4);
    const float v = alpha * s;
    for (size_t k = 0; k < c; ++k) {
      const bool bit = ((in[j * cb + 4 + k / 8] >> (7 - k % 8)) & 1u) != 0;
      const float val = bit ? v : -v;
      out[j * c + k] = acc ? out[j * c + k] + val : val;
    }
  }
}

inline std::vector<uint8_t> ef8_encode(const std::vector<float>& x, std::vector<float>* e,
                                       size_t chunks) {
  const size_t n = x.size();
  const size_t c = n / chunks;
  std::vector<uint8_t> out(chunks * (4 + c));
  for (size_t j = 0; j < chunks; ++j) {
    float m = 0.0f;
    for (size_t k = 0; k < c; ++k) {
      const size_t i = j * c + k;
      const float b = e != nullptr ? x[i] + (*e)[i] : x[i];
      m = std::max(m, std::fabs(b));
    }
    const float scale = m / 127.0f;
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    std::memcpy(out.data() + j * (4 + c), &scale, 4);
    for (size_t k = 0; k < c; ++k) {
      const size_t i = j * c + k;
      const float b = e != nullptr ? x[i] + (*e)[i] : x[i];
      const float r = std::clamp(std::nearbyint(b * inv), -127.0f, 127.0f);
      out[j * (4 + c) + 4 + k] = static_cast<uint8_t>(static_cast<int8_t>(r));
      if (e != nullptr) (*e)[i] = b - r * scale;
    }
  }
  return out;
}

inline void ef8_decode(const uint8_t* in, size_t chunks, size_t c, float alpha, bool acc,
                       float* out) {
  for (size_t j = 0; j < chunks; ++j) {
    float s;
    std::memcpy(&s, in + j * (4 + c), 4);
    const float v = alpha * s;
    for (size_t k = 0; k < c; ++k) {
      const float val = v * static_cast<float>(static_cast<int8_t>(in[j * (4 + c) + 4 + k]));
      out[j * c + k] = acc ? out[j * c + k] + val : val;
    }
  }
}

// One codec as the reference sees it.
struct Codec {
  bool onebit = true;
  uint64_t padded(uint64_t numel, uint64_t n) const {
    return onebit ? onebit_padded(numel, n) : (std::max<uint64_t>(numel, 1) + n - 1) / n * n;
  }
  size_t chunk_bytes(size_t c) const { return onebit ? 4 + c / 8 : 4 + c; }
  std::vector<uint8_t> encode(const std::vector<float>& x, std::vector<float>* e,
                              size_t chunks) const {
    return onebit ? onebit_encode(x, e, chunks) : ef8_encode(x, e, chunks);
  }
  void decode(const uint8_t* in, size_t chunks, size_t c, float alpha, bool acc, float* out) const {
    if (onebit) {
      onebit_decode(in, chunks, c, alpha, acc, out);
    } else {
      ef8_decode(in, chunks, c, alpha, acc, out);
    }
  }
};

// The workers' step: rank i's input, zero-padded to N, encoded with its worker error we[i]
// into n chunks (chunk r goes to rank r).
inline std::vector<std::vector<uint8_t>> worker_encode(const Codec& codec,
                                                       const std::vector<std::vector<float>>& xs,
                                                       std::vector<std::vector<float>>& we) {
  const size_t n = xs.size();
  const size_t N = we[0].size();
  std::vector<std::vector<uint8_t>> sent(n);
  for (size_t i = 0; i < n; ++i) {
    std::vector<float> b(N, 0.0f);
    std::copy(xs[i].begin(), xs[i].end(), b.begin());
    sent[i] = codec.encode(b, &we[i], n);
  }
  return sent;
}

// The two-phase compressed allreduce of 1-bit Adam over n simulated ranks. xs[i] is rank
// i's input (numel each); we[i] (padded N) and se[i] (N / n) are its error buffers (in/out).
// Returns the output every rank must see.
inline std::vector<float> compressed_allreduce(const Codec& codec,
                                               const std::vector<std::vector<float>>& xs,
                                               std::vector<std::vector<float>>& we,
                                               std::vector<std::vector<float>>& se) {
  const size_t n = xs.size();
  const size_t numel = xs[0].size();
  const size_t N = we[0].size();
  const size_t c = N / n;
  const size_t cb = codec.chunk_bytes(c);
  const std::vector<std::vector<uint8_t>> sent = worker_encode(codec, xs, we);
  std::vector<uint8_t> gathered;
  for (size_t r = 0; r < n; ++r) {
    std::vector<float> a(c);
    for (size_t i = 0; i < n; ++i) {
      codec.decode(sent[i].data() + r * cb, 1, c, 1.0f / static_cast<float>(n), i > 0, a.data());
    }
    const std::vector<uint8_t> chunk = codec.encode(a, &se[r], 1);
    gathered.insert(gathered.end(), chunk.begin(), chunk.end());
  }
  std::vector<float> out(N);
  codec.decode(gathered.data(), n, c, 1.0f, false, out.data());
  out.resize(numel);
  return out;
}

// Its first half (CompressedAllreduce::reduce_scatter): rank r's slice is the average of the
// ranks' decoded chunk r, before any re-encode. Returns the n slices (N / n each); we[i] is
// updated, no server error is used.
inline std::vector<std::vector<float>> compressed_reduce_scatter(
    const Codec& codec, const std::vector<std::vector<float>>& xs,
    std::vector<std::vector<float>>& we) {
  const size_t n = xs.size();
  const size_t N = we[0].size();
  const size_t c = N / n;
  const size_t cb = codec.chunk_bytes(c);
  const std::vector<std::vector<uint8_t>> sent = worker_encode(codec, xs, we);
  std::vector<std::vector<float>> slices(n, std::vector<float>(c));
  for (size_t r = 0; r < n; ++r) {
    for (size_t i = 0; i < n; ++i) {
      codec.decode(sent[i].data() + r * cb, 1, c, 1.0f / static_cast<float>(n), i > 0,
                   slices[r].data());
    }
  }
  return slices;
}

}  // namespace ref
