// Every validation error: the right code, a message naming the problem, raised before any work.
#include <atomic>
#include <cmath>

#include "layer_fixture.hpp"

using namespace moka;
using namespace moka::test;

namespace {

// Runs the layer and returns the error (fails the test if none is thrown).
Error forward_error(const MoeShape& s, Buffers<float>& b, const LayerOptions& o = {4, 1}) {
  try {
    auto layer = make_moe_layer(s, Backend::cpu, nullptr, o);
    layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error raised";
  return Error(ErrorCode::internal, "none");
}

void expect_error(const Error& e, ErrorCode code, const std::string& fragment) {
  EXPECT_EQ(e.code(), code) << e.what();
  EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
}

TEST(Validation, ExpertIdOutOfRange) {
  const MoeShape s = small_shape();
  auto b = random_buffers<float>(s, 1, 6, 1);
  b.topk_ids[5] = 4;
  expect_error(forward_error(s, b), ErrorCode::expert_out_of_range, "topk_ids[2, 1] = 4");
  b.topk_ids[5] = -1;
  expect_error(forward_error(s, b), ErrorCode::expert_out_of_range, "= -1");
}

// The code's name prefixes the message once, on one rank as across ranks.
TEST(Validation, OneRankErrorNamesItsCodeOnce) {
  const MoeShape s = small_shape();
  auto b = random_buffers<float>(s, 1, 6, 1);
  b.topk_ids[5] = 4;
  const std::string what = forward_error(s, b).what();
  const std::string code = to_string(ErrorCode::expert_out_of_range);
  EXPECT_EQ(what.find(code), 0u) << what;
  EXPECT_EQ(what.find(code, code.size()), std::string::npos) << what;
}

TEST(Validation, DuplicateExpertInTopK) {
  const MoeShape s = small_shape();
  auto b = random_buffers<float>(s, 1, 6, 1);
  b.topk_ids[7] = b.topk_ids[6];
  expect_error(forward_error(s, b), ErrorCode::duplicate_expert, "token 3");
}

TEST(Validation, NonFiniteRouterWeights) {
  const MoeShape s = small_shape();
  auto b = random_buffers<float>(s, 1, 6, 1);
  b.topk_weights[3] = std::nanf("");
  expect_error(forward_error(s, b), ErrorCode::non_finite, "topk_weights[1, 1]");
  b.topk_weights[3] = INFINITY;
  expect_error(forward_error(s, b), ErrorCode::non_finite, "topk_weights[1, 1]");
}

TEST(Validation, ShapesThatDisagree) {
  const MoeShape s = small_shape();
  auto b = random_buffers<float>(s, 1, 6, 1);
  auto in = b.inputs();
  in.x.shape[1] = 7;
  try {
    make_moe_layer(s, Backend::cpu)->forward(in, b.weights(), b.out_view(), Stream{});
    FAIL();
  } catch (const Error& e) {
    expect_error(e, ErrorCode::shape_mismatch, "x has shape [6, 7]");
  }
  auto w = b.weights();
  w.w_down.shape[0] = 3;
  try {
    make_moe_layer(s, Backend::cpu)->forward(b.inputs(), w, b.out_view(), Stream{});
    FAIL();
  } catch (const Error& e) {
    expect_error(e, ErrorCode::shape_mismatch, "w_down");
  }
}

TEST(Validation, DtypeTheBackendCannotTake) {
  const MoeShape s = small_shape();
  auto b = random_buffers<float>(s, 1, 6, 1);
  auto in = b.inputs();
  in.x.dtype = DType::bf16;
  try {
    make_moe_layer(s, Backend::cpu)->forward(in, b.weights(), b.out_view(), Stream{});
    FAIL();
  } catch (const Error& e) {
    expect_error(e, ErrorCode::invalid_argument, "bf16");
  }
}

TEST(Validation, SharedExpertGivenToAShapeWithoutOne) {
  const MoeShape s = small_shape(Activation::swiglu, 0);
  auto b = random_buffers<float>(s, 1, 6, 1);
  auto w = b.weights();
  w.ws_gate = b.weights().w_gate;
  try {
    make_moe_layer(s, Backend::cpu)->forward(b.inputs(), w, b.out_view(), Stream{});
    FAIL();
  } catch (const Error& e) {
    expect_error(e, ErrorCode::invalid_argument, "no shared expert");
  }
}

TEST(Validation, ImpossibleShapes) {
  auto expect_shape_error = [](MoeShape s, int world, const std::string& fragment) {
    try {
      run_emulated_ranks(world, [&](ProcessGroup& g) { make_moe_layer(s, Backend::cpu, &g); });
      FAIL() << fragment;
    } catch (const Error& e) {
      expect_error(e, ErrorCode::invalid_argument, fragment);
    }
  };
  expect_shape_error(MoeShape{8, 6, 6, 2, 0}, 4, "not divisible");
  expect_shape_error(MoeShape{8, 6, 4, 5, 0}, 1, "top_k 5 exceeds");
  expect_shape_error(MoeShape{0, 6, 4, 2, 0}, 1, "hidden must be positive");
  EXPECT_THROW(make_moe_layer(small_shape(), Backend::cpu, nullptr, LayerOptions{0, 1}), Error);
}

TEST(Validation, BadInputOnOneRankIsReportedOnEveryRank) {
  const MoeShape s = small_shape();
  std::atomic<int> reported{0};
  run_emulated_ranks(4, [&](ProcessGroup& g) {
    auto b = random_buffers<float>(s, 4, 6, 1, core::RoutingKind::uniform, g.rank());
    if (g.rank() == 2) b.topk_ids[0] = 99;
    auto layer = make_moe_layer(s, Backend::cpu, &g, LayerOptions{4, 1});
    try {
      layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
    } catch (const Error& e) {
      expect_error(e, ErrorCode::expert_out_of_range, "rank 2: topk_ids[0, 0] = 99");
      ++reported;
    }
  });
  EXPECT_EQ(reported.load(), 4);
}

TEST(Validation, RanksThatDisagreeOnTokens) {
  const MoeShape s = small_shape();
  std::atomic<int> reported{0};
  run_emulated_ranks(2, [&](ProcessGroup& g) {
    auto b = random_buffers<float>(s, 2, g.rank() == 0 ? 6 : 5, 1, core::RoutingKind::uniform, g.rank());
    auto layer = make_moe_layer(s, Backend::cpu, &g, LayerOptions{4, 1});
    try {
      layer->forward(b.inputs(), b.weights(), b.out_view(), Stream{});
    } catch (const Error& e) {
      expect_error(e, ErrorCode::shape_mismatch, "rank 1 has T=5");
      ++reported;
    }
  });
  EXPECT_EQ(reported.load(), 2);
}

TEST(Validation, ARankThatThrowsDoesNotHangItsPeers) {
  try {
    run_emulated_ranks(3, [&](ProcessGroup& g) {
      if (g.rank() == 1) throw Error(ErrorCode::invalid_argument, "rank 1 gives up");
      g.barrier();
    });
    FAIL();
  } catch (const Error& e) {
    expect_error(e, ErrorCode::invalid_argument, "rank 1 gives up");
  }
}

TEST(Validation, APeerThatNeverArrivesTimesOut) {
  try {
    run_emulated_ranks(
        2,
        [&](ProcessGroup& g) {
          if (g.rank() == 0) g.barrier();
        },
        EmulationOptions{0.2});
    FAIL();
  } catch (const Error& e) {
    expect_error(e, ErrorCode::timeout, "rank 0");
  }
}

}  // namespace
