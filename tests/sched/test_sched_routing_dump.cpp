// The routing-dump reader of `moka simulate --replay` against truncated and corrupted files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "moka/error.hpp"
#include "sched/routing_dump.hpp"
#include "sched/traffic.hpp"

using namespace moka::sched;

namespace {

// A dump line as `moka bench --dump-routing` writes it: 2 ranks, 2 tokens, top-2 of 4 experts.
const std::string kEpoch = R"({"shape":"tiny","world_size":2,"tokens_per_rank":2,"top_k":2,"num_experts":4,"hidden":8,)"
                           R"("topk_ids":[[0,2,1,3],[3,0,2,1]]})";

// kEpoch with `from` replaced by `to` (which must occur).
std::string edited(const std::string& from, const std::string& to) {
  std::string s = kEpoch;
  const auto at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return s.replace(at, from.size(), to);
}

std::string write_dump(const std::string& name, const std::string& text) {
  const auto path = (std::filesystem::temp_directory_path() / ("moka_routing_dump_" + name + ".jsonl")).string();
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The message of the error reading `text`, which must fail.
std::string read_error(const std::string& name, const std::string& text) {
  const auto path = write_dump(name, text);
  try {
    read_routing_dump(path);
  } catch (const moka::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << "the message names the file: " << what;
    return what;
  }
  ADD_FAILURE() << name << ": read without error";
  return {};
}

// A dump that must fail to read, and a fragment of the message it must fail with.
struct BadDump {
  std::string name, text, fragment;
};

void expect_read_errors(const std::vector<BadDump>& cases) {
  for (const auto& c : cases) {
    const std::string what = read_error(c.name, c.text);
    EXPECT_NE(what.find(c.fragment), std::string::npos) << c.name << ": expected '" << c.fragment << "' in: " << what;
  }
}

}  // namespace

TEST(SchedRoutingDump, ReadsEveryEpoch) {
  const auto epochs =
      read_routing_dump(write_dump("valid", kEpoch + "\n\n" + edited("\"hidden\":8", "\"hidden\":16") + "\n"));
  ASSERT_EQ(epochs.size(), 2u);
  EXPECT_EQ(epochs[0].shape, "tiny");
  EXPECT_EQ(epochs[0].top_k, 2);
  EXPECT_EQ(epochs[0].num_experts, 4);
  EXPECT_EQ(epochs[1].hidden, 16);
  EXPECT_EQ(epochs[0].topk_ids, (std::vector<std::vector<int32_t>>{{0, 2, 1, 3}, {3, 0, 2, 1}}));
}

TEST(SchedRoutingDump, TruncatedOrGarbageNamesTheLine) {
  expect_read_errors({
      {"truncated", kEpoch + "\n" + kEpoch.substr(0, kEpoch.size() / 2), "line 2: not valid JSON"},
      {"garbage", std::string("\x00\xff\x13garbage", 10), "line 1: not valid JSON"},
      {"not_an_object", "[1,2,3]", "expected a JSON object, got array"},
      {"empty", "\n  \n", "holds no epoch"},
  });
  EXPECT_THROW(read_routing_dump("/nonexistent/moka_dump.jsonl"), moka::Error);
}

TEST(SchedRoutingDump, MissingFieldsAndWrongTypes) {
  expect_read_errors({
      {"missing_hidden", edited("\"hidden\":8,", ""), "missing 'hidden'"},
      {"top_k_string", edited("\"top_k\":2", "\"top_k\":\"2\""), "'top_k' must be an integer"},
      {"experts_float", edited("\"num_experts\":4", "\"num_experts\":1e30"), "'num_experts' must be an integer"},
      {"ids_number", edited("[[0,2,1,3],[3,0,2,1]]", "7"), "'topk_ids' must be an array"},
      {"rank_object", edited("[3,0,2,1]", "{}"), "topk_ids[1] must be an array"},
      {"id_fraction", edited("[0,2,1,3]", "[0,2.5,1,3]"), "topk_ids[0][1] (an expert id) must be an integer"},
      {"shape_number", edited("\"tiny\"", "3"), "'shape' must be a string"},
  });
}

TEST(SchedRoutingDump, CountsOutOfRange) {
  expect_read_errors({
      {"top_k_zero", edited("\"top_k\":2", "\"top_k\":0"), "'top_k' is 0, outside [1, 4]"},
      {"top_k_negative", edited("\"top_k\":2", "\"top_k\":-3"), "'top_k' is -3"},
      {"top_k_huge", edited("\"top_k\":2", "\"top_k\":18446744073709551615"), "'top_k' is 18446744073709551615"},
      {"experts_negative", edited("\"num_experts\":4", "\"num_experts\":-4"), "'num_experts' is -4"},
      {"experts_huge", edited("\"num_experts\":4", "\"num_experts\":9223372036854775807"), "'num_experts' is"},
      {"hidden_zero", edited("\"hidden\":8", "\"hidden\":0"), "'hidden' is 0"},
      {"experts_uneven", edited("\"num_experts\":4", "\"num_experts\":5"), "5 experts do not divide over 2 ranks"},
      {"tokens_huge", edited("\"tokens_per_rank\":2", "\"tokens_per_rank\":99999999999"),
       "'tokens_per_rank' disagrees"},
      {"world_wrong", edited("\"world_size\":2", "\"world_size\":-2"), "'world_size' is -2"},
      {"one_rank", edited("[[0,2,1,3],[3,0,2,1]]", "[[0,2,1,3]]"), "holds 1 ranks, at least 2"},
  });
}

TEST(SchedRoutingDump, IdsAndTokenCounts) {
  expect_read_errors({
      {"id_high", edited("[3,0,2,1]", "[3,0,2,4]"), "topk_ids[1][3] (an expert id) is 4, outside [0, 3]"},
      {"id_negative", edited("[0,2,1,3]", "[0,-1,1,3]"), "topk_ids[0][1] (an expert id) is -1"},
      {"ids_not_tokens_x_k", edited("[[0,2,1,3],[3,0,2,1]]", "[[0,2,1],[3,0,2]]"),
       "topk_ids[0] holds 3 ids, not a positive multiple of top_k 2"},
      {"no_tokens", edited("[[0,2,1,3],[3,0,2,1]]", "[[],[]]"), "topk_ids[0] holds 0 ids"},
      {"ranks_disagree", edited("[3,0,2,1]", "[3,0]"), "topk_ids[1] holds 2 ids, rank 0 holds 4"},
  });
}

TEST(SchedRoutingDump, TrafficFromRoutingRefusesTopKZeroAndForeignIds) {
  EXPECT_THROW(traffic_from_routing({{0, 1}, {2, 3}}, 0, 4, 8, CountMode::per_route), moka::Error);
  EXPECT_THROW(traffic_from_routing({{0, 4}, {2, 3}}, 2, 4, 8, CountMode::per_route), moka::Error);
}

// A probe's dump: ~100k nested arrays once overflowed the stack when the error path serialized them.
TEST(SchedRoutingDump, DeepNestingIsRefused) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  expect_read_errors({
      {"deep_field", edited("\"num_experts\":4", "\"num_experts\":" + deep), "nested deeper than 64"},
      {"deep_line", deep, "nested deeper than 64"},
  });
}

// An offending value is shown as a short excerpt, not serialized whole into the message.
TEST(SchedRoutingDump, HugeValuesAreNotDumped) {
  std::string zeros = "[0";
  for (int i = 1; i < 100000; ++i) zeros += ",0";
  zeros += "]";
  const std::vector<BadDump> cases = {
      {"huge_string", edited("\"top_k\":2", "\"top_k\":\"" + std::string(100000, 'x') + "\""), "'top_k' must be"},
      {"huge_array", edited("\"num_experts\":4", "\"num_experts\":" + zeros), "'num_experts' must be"},
      {"huge_id", edited("[0,2,1,3]", "[0,2,1,\"" + std::string(100000, 'y') + "\"]"), "topk_ids[0][3]"},
      {"huge_token", edited("\"tiny\"", "\"" + std::string(100000, 'z') + "\t\""), "not valid JSON"},
  };
  expect_read_errors(cases);
  for (const auto& c : cases) EXPECT_LT(read_error(c.name, c.text).size(), 500u) << c.name;
}

TEST(SchedRoutingDump, RanksBeyondTheCap) {
  std::string ranks = "[[0]";
  for (int r = 1; r <= kMaxRanks; ++r) ranks += ",[0]";
  ranks += "]";
  expect_read_errors({{"too_many_ranks", edited("[[0,2,1,3],[3,0,2,1]]", ranks),
                       "holds " + std::to_string(kMaxRanks + 1) + " ranks, at most " + std::to_string(kMaxRanks)}});
}
