// Helpers shared by the megakernel emulation tests (forward and backward).
#pragma once
#include <chrono>
#include <initializer_list>
#include <string>

#include "layer_fixture.hpp"
#include "moka/megakernel.hpp"

namespace moka::test {

// A config with room for every route (capacity_multiplier 1) and a wait bound no healthy run
// reaches on a loaded CI machine.
inline MegakernelConfig emulation_config(int comm, int64_t tile_m, int64_t minibatch, int64_t macrobatch) {
  MegakernelConfig c;
  c.num_comm_sms = comm;
  c.tile_rows = tile_m;
  c.minibatch_size = minibatch;
  c.macrobatch_size = macrobatch;
  c.capacity_multiplier = 1.0;
  c.spin_timeout_seconds = 20.0;
  return c;
}

// The CPU reference layer on every rank of `ranks`: `step(layer, buffers)` runs forward, or
// forward and backward.
template <typename T, typename Step>
void run_reference_ranks(const MoeShape& s, std::vector<Buffers<T>>& ranks, int64_t tile_rows, Step&& step) {
  run_emulated_ranks(static_cast<int>(ranks.size()), [&](ProcessGroup& g) {
    auto layer = make_moe_layer(s, Backend::cpu, &g, LayerOptions{tile_rows, 1});
    step(*layer, ranks[g.rank()]);
  });
}

// Runs `run`, which must throw an Error of `code` naming every one of `parts`, in < 10 s (a
// stalled peer must end in an error, never a hang).
template <typename Run>
void expect_prompt_error(Run&& run, ErrorCode code, std::initializer_list<const char*> parts) {
  const auto start = std::chrono::steady_clock::now();
  try {
    run();
    ADD_FAILURE() << "no error reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    const std::string what = e.what();
    for (const char* part : parts)
      EXPECT_NE(what.find(part), std::string::npos) << "missing '" << part << "' in: " << what;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

}  // namespace moka::test
