// Fuzzing the routing-dump reader of `moka simulate --replay` with deterministic mutations of a
// valid two-epoch dump: every truncation, byte replacements, hostile values in every field, and
// files that are no dump at all. Each is read as what it says or refused naming the file.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "reader_fuzz.hpp"
#include "sched/routing_dump.hpp"
#include "sched/traffic.hpp"

using namespace moka::sched;
using namespace moka::testing;

namespace {

// Two epochs as `moka bench --dump-routing` writes them (the second without the optional fields).
const std::string kFirstLine =
    R"({"shape":"tiny","world_size":2,"tokens_per_rank":2,"top_k":2,"num_experts":4,"hidden":8,)"
    R"("topk_ids":[[0,2,1,3],[3,0,2,1]]})";
const std::string kSecondLine = R"({"top_k":1,"num_experts":2,"hidden":16,"topk_ids":[[1],[0]]})";
const std::string kDump = kFirstLine + "\n" + kSecondLine + "\n";

std::vector<RoutingEpoch> written_epochs() {
  return {{"tiny", 2, 4, 8, {{0, 2, 1, 3}, {3, 0, 2, 1}}}, {"", 1, 2, 16, {{1}, {0}}}};
}

void expect_same(const RoutingEpoch& read, const RoutingEpoch& written, const std::string& mutation) {
  EXPECT_EQ(read.shape, written.shape) << mutation;
  EXPECT_EQ(read.top_k, written.top_k) << mutation;
  EXPECT_EQ(read.num_experts, written.num_experts) << mutation;
  EXPECT_EQ(read.hidden, written.hidden) << mutation;
  EXPECT_EQ(read.topk_ids, written.topk_ids) << mutation;
}

// What read_routing_dump promises of every epoch it returns.
void expect_valid(const RoutingEpoch& e, const std::string& mutation) {
  ASSERT_GE(e.topk_ids.size(), 2u) << mutation;
  ASSERT_LE(int64_t(e.topk_ids.size()), kMaxRanks) << mutation;
  EXPECT_TRUE(e.num_experts >= 2 && e.num_experts % int64_t(e.topk_ids.size()) == 0) << mutation;
  EXPECT_TRUE(e.top_k >= 1 && e.top_k <= e.num_experts) << mutation;
  EXPECT_GE(e.hidden, 1) << mutation;
  const size_t slots = e.topk_ids[0].size();
  EXPECT_TRUE(slots > 0 && slots % size_t(e.top_k) == 0) << mutation;
  for (const auto& ids : e.topk_ids) {
    EXPECT_EQ(ids.size(), slots) << mutation;
    for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < e.num_experts) << mutation << ": id " << id;
  }
}

class RoutingDumpFuzz : public ScratchFolder {
 protected:
  ReadOutcome<std::vector<RoutingEpoch>> read(const std::string& text, const std::string& mutation) {
    return read_outcome(read_routing_dump, write("dump.jsonl", text), mutation);
  }
};

}  // namespace

// A cut at a line's end leaves the epochs before it; a cut inside a line is refused at that line.
TEST_F(RoutingDumpFuzz, EveryTruncationKeepsWholeEpochsOrIsRefused) {
  const auto written = written_epochs();
  for (size_t length = 0; length <= kDump.size(); ++length) {
    const std::string prefix = kDump.substr(0, length);
    const std::string mutation = "cut to " + std::to_string(length) + " bytes";
    const auto newlines = std::count(prefix.begin(), prefix.end(), '\n');
    const bool cut_inside_a_line = length > 0 && prefix.back() != '\n' && kDump[length] != '\n';
    const auto outcome = read(prefix, mutation);
    if (cut_inside_a_line) {
      EXPECT_NE(outcome.error.find("line " + std::to_string(newlines + 1) + ": not valid JSON"), std::string::npos)
          << mutation << ": " << outcome.error;
    } else if (length == 0) {
      EXPECT_NE(outcome.error.find("holds no epoch"), std::string::npos) << mutation << ": " << outcome.error;
    } else {
      ASSERT_TRUE(outcome.value) << mutation << ": " << outcome.error;
      ASSERT_EQ(outcome.value->size(), size_t(newlines) + (prefix.back() != '\n')) << mutation;
      for (size_t e = 0; e < outcome.value->size(); ++e) expect_same((*outcome.value)[e], written[e], mutation);
    }
  }
}

// A replaced byte may still make a valid dump (another id, another hidden size); what is read
// then keeps every promise of the reader.
TEST_F(RoutingDumpFuzz, ReplacedBytesReadValidEpochsOrAreRefused) {
  std::mt19937 rng(20261202);
  for (size_t at = 0; at < kDump.size(); ++at)
    for (int draw = 0; draw < 2; ++draw) {
      const std::string mutation = "byte " + std::to_string(at) + " replaced (draw " + std::to_string(draw) + ")";
      const auto outcome = read(with_byte_replaced(kDump, at, rng), mutation);
      if (outcome.value)
        for (const auto& epoch : *outcome.value) expect_valid(epoch, mutation);
    }
}

// Every field given a value it cannot take is refused by name (or as not JSON, for NaN and the like).
TEST_F(RoutingDumpFuzz, HostileValuesAreRefusedNamingTheField) {
  struct Field {
    std::string text, name;  // the field as kFirstLine writes it, and as the error names it
  };
  const std::vector<Field> fields = {
      {R"("top_k":2)", "'top_k'"},
      {R"("num_experts":4)", "'num_experts'"},
      {R"("hidden":8)", "'hidden'"},
      {R"("world_size":2)", "'world_size'"},
      {R"("tokens_per_rank":2)", "'tokens_per_rank'"},
      {R"("topk_ids":[[0,2,1,3],[3,0,2,1]])", "'topk_ids'"},
      {"[3,0,2,1]", "topk_ids[1]"},
      {"[0,2,1,3]", "topk_ids[0]"},
  };
  for (const auto& field : fields)
    for (const auto& value : kHostileJsonValues) {
      std::string line = kFirstLine;
      const size_t at = line.find(field.text);
      ASSERT_NE(at, std::string::npos) << field.text;
      const size_t value_at = field.text.find(':') == std::string::npos ? 0 : field.text.find(':') + 1;
      line.replace(at + value_at, field.text.size() - value_at, value);
      const std::string mutation = field.name + " = " + value;
      const auto outcome = read(line + "\n", mutation);
      const bool named = outcome.error.find(field.name) != std::string::npos ||
                         outcome.error.find("not valid JSON") != std::string::npos;
      EXPECT_TRUE(!outcome.value && named) << mutation << ": " << outcome.error;
    }
}

// Ids that pass one by one, in arrays the other fields disagree with.
TEST_F(RoutingDumpFuzz, IdValuesAreRefusedNamingTheSlot) {
  for (const auto& value : kHostileJsonValues) {
    std::string line = kFirstLine;
    line.replace(line.find("[0,2,1,3]"), 9, "[0," + value + ",1,3]");
    const auto outcome = read(line + "\n", "id " + value);
    const bool named = outcome.error.find("topk_ids[0][1] (an expert id)") != std::string::npos ||
                       outcome.error.find("not valid JSON") != std::string::npos;
    EXPECT_TRUE(!outcome.value && named) << "id " << value << ": " << outcome.error;
  }
}

TEST_F(RoutingDumpFuzz, FilesThatHoldNoDumpAreRefused) {
  const std::vector<std::pair<std::string, std::string>> not_dumps = {
      {"empty", ""},
      {"blank lines", "\n \t\r\n\n"},
      {"NUL bytes", std::string(64, '\0')},
      {"binary", "\x89PNG\r\n\x1a\n\xff\xfe"},
      {"object without fields", "{}\n"},
      {"a number", "4\n"},
      {"unclosed string", "{\"shape\":\"" + std::string(10000, 'x')},
  };
  for (const auto& [name, text] : not_dumps) EXPECT_FALSE(read(text, name).value) << name;
  EXPECT_FALSE(read_outcome(read_routing_dump, path("missing.jsonl"), "a missing file").value);
  const auto folder = path("a_folder.jsonl");
  std::filesystem::create_directory(folder);
  const auto outcome = read_outcome(read_routing_dump, folder, "a folder");
  EXPECT_NE(outcome.error.find("is a directory"), std::string::npos) << outcome.error;
}

// What other writers may add (a byte-order mark, CRLF line ends) reads as the same epochs.
TEST_F(RoutingDumpFuzz, ByteOrderMarkAndCrlfReadTheSame) {
  const auto written = written_epochs();
  for (const std::string& text : {"\xEF\xBB\xBF" + kDump, kFirstLine + "\r\n" + kSecondLine + "\r\n"}) {
    const auto outcome = read(text, "BOM or CRLF");
    ASSERT_TRUE(outcome.value) << outcome.error;
    ASSERT_EQ(outcome.value->size(), 2u);
    for (size_t e = 0; e < 2; ++e) expect_same((*outcome.value)[e], written[e], "BOM or CRLF");
  }
}
