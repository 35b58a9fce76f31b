#include "sched/routing_dump.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "moka/error.hpp"
#include "sched/traffic.hpp"

namespace moka::sched {
namespace {

using nlohmann::json;

// Largest expert count and row width a dump may declare: beyond any real model, small enough
// that ids fit int32 and bytes per row cannot overflow.
constexpr int64_t kMaxExperts = int64_t{1} << 20;
constexpr int64_t kMaxHidden = int64_t{1} << 24;

// Deepest nesting of arrays and objects a line may hold: an epoch needs 3 (the object, topk_ids,
// a rank's ids). nlohmann's parser is iterative but dump() recurses: ~100k nested arrays once
// overflowed the stack in an error message.
constexpr int kMaxDepth = 64;

// Longest excerpt of an offending value an error message shows.
constexpr size_t kMaxExcerpt = 40;

// Errors of one line of the dump carry "routing dump PATH line N: ".
struct LineContext {
  const std::string& path;
  int64_t line;  // a file of 2^31 empty lines must not overflow it
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorCode::invalid_argument, "routing dump " + path + " line " + std::to_string(line) + ": " + what);
  }
  void check(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
};

// `text` cut to kMaxExcerpt characters, saying how long it was.
std::string shortened(const std::string& text) {
  if (text.size() <= kMaxExcerpt) return text;
  return text.substr(0, kMaxExcerpt) + "... (" + std::to_string(text.size()) + " characters)";
}

// `value` for an error message: a scalar as JSON, shortened; an array or object only by its type
// and size, never serialized (it may be huge).
std::string excerpt(const json& value) {
  if (value.is_structured())
    return std::string(value.type_name()) + " of " + std::to_string(value.size()) + " elements";
  return shortened(value.dump());
}

std::string range_text(int64_t lo, int64_t hi) {
  std::string text = "[";  // appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "[" + to_string
  text += std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return text;
}

int64_t integer_in(const LineContext& at, const json& value, const std::string& name, int64_t lo, int64_t hi) {
  at.check(value.is_number_integer(), name + " must be an integer, got " + excerpt(value));
  const bool fits_int64 = !value.is_number_unsigned() ||
                          value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  const int64_t v = fits_int64 ? value.get<int64_t>() : hi;
  at.check(fits_int64 && v >= lo && v <= hi, name + " is " + excerpt(value) + ", outside " + range_text(lo, hi));
  return v;
}

const json& field(const LineContext& at, const json& j, const char* name) {
  at.check(j.contains(name), std::string("missing '") + name + "'");
  return j.at(name);
}

// Rank `rank`'s ids: integers in [0, num_experts).
std::vector<int32_t> rank_ids(const LineContext& at, const json& ids, int rank, int num_experts) {
  const std::string where = "topk_ids[" + std::to_string(rank) + "]";
  at.check(ids.is_array(), where + " must be an array of expert ids, got " + std::string(ids.type_name()));
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (size_t slot = 0; slot < ids.size(); ++slot)
    out.push_back(static_cast<int32_t>(
        integer_in(at, ids[slot], where + "[" + std::to_string(slot) + "] (an expert id)", 0, num_experts - 1)));
  return out;
}

RoutingEpoch parse_epoch(const LineContext& at, const std::string& text) {
  json j;
  try {
    j = json::parse(text, [&at](int depth, json::parse_event_t event, json&) {
      // `depth` counts the arrays and objects around the one that starts.
      const bool starts = event == json::parse_event_t::array_start || event == json::parse_event_t::object_start;
      if (starts && depth >= kMaxDepth)
        at.fail("nested deeper than " + std::to_string(kMaxDepth) + " arrays or objects");
      return true;
    });
  } catch (const json::exception& e) {
    // A syntax error (parse_error), or a number beyond double's range such as 1e999
    // (out_of_range). nlohmann's message ends with the token read, which may be a whole (huge)
    // string or number: "...; last read: TOKEN" or "number overflow parsing 'TOKEN'".
    std::string what = e.what();
    for (const std::string token_start : {"last read: ", "overflow parsing "})
      if (const size_t token = what.find(token_start); token != std::string::npos) {
        what = what.substr(0, token + token_start.size()) + shortened(what.substr(token + token_start.size()));
        break;
      }
    at.fail("not valid JSON (truncated or corrupted?): " + what);
  }
  at.check(j.is_object(), "expected a JSON object, got " + std::string(j.type_name()));
  RoutingEpoch epoch;
  if (j.contains("shape")) {
    at.check(j["shape"].is_string(), "'shape' must be a string");
    epoch.shape = j["shape"].get<std::string>();
  }
  epoch.num_experts = static_cast<int>(integer_in(at, field(at, j, "num_experts"), "'num_experts'", 2, kMaxExperts));
  epoch.top_k = static_cast<int>(integer_in(at, field(at, j, "top_k"), "'top_k'", 1, epoch.num_experts));
  epoch.hidden = integer_in(at, field(at, j, "hidden"), "'hidden'", 1, kMaxHidden);
  const json& ids = field(at, j, "topk_ids");
  at.check(ids.is_array(), "'topk_ids' must be an array (one per rank), got " + std::string(ids.type_name()));
  const auto world = static_cast<int64_t>(ids.size());
  at.check(world >= 2, "'topk_ids' holds " + std::to_string(world) + " ranks, at least 2 are needed");
  at.check(world <= kMaxRanks, "'topk_ids' holds " + std::to_string(world) + " ranks, at most " +
                                   std::to_string(kMaxRanks) + " are simulated (the cap of --gpus)");
  at.check(epoch.num_experts % world == 0,
           std::to_string(epoch.num_experts) + " experts do not divide over " + std::to_string(world) + " ranks");
  if (j.contains("world_size"))
    at.check(integer_in(at, j["world_size"], "'world_size'", 2, world) == world,
             "'world_size' disagrees with the " + std::to_string(world) + " ranks of 'topk_ids'");
  for (int r = 0; r < world; ++r) epoch.topk_ids.push_back(rank_ids(at, ids[r], r, epoch.num_experts));
  const auto slots = static_cast<int64_t>(epoch.topk_ids[0].size());
  at.check(slots > 0 && slots % epoch.top_k == 0, "topk_ids[0] holds " + std::to_string(slots) +
                                                      " ids, not a positive multiple of top_k " +
                                                      std::to_string(epoch.top_k));
  for (int r = 1; r < world; ++r)
    at.check(static_cast<int64_t>(epoch.topk_ids[r].size()) == slots,
             "topk_ids[" + std::to_string(r) + "] holds " + std::to_string(epoch.topk_ids[r].size()) +
                 " ids, rank 0 holds " + std::to_string(slots) + " (every rank routes the same token count)");
  if (j.contains("tokens_per_rank"))
    at.check(integer_in(at, j["tokens_per_rank"], "'tokens_per_rank'", 1, std::numeric_limits<int64_t>::max()) ==
                 slots / epoch.top_k,
             "'tokens_per_rank' disagrees with topk_ids (" + std::to_string(slots / epoch.top_k) + " tokens)");
  return epoch;
}

}  // namespace

std::vector<RoutingEpoch> read_routing_dump(const std::string& path) {
  // A directory opens as a stream on Linux and fails only at the first read, with a vaguer message.
  std::error_code ec;
  require(!std::filesystem::is_directory(path, ec), ErrorCode::io, "routing dump " + path + " is a directory");
  std::ifstream in(path);
  require(in.good(), ErrorCode::io, "cannot read routing dump " + path);
  std::vector<RoutingEpoch> out;
  int64_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    out.push_back(parse_epoch(LineContext{path, line_number}, line));
  }
  require(!in.bad(), ErrorCode::io, "error reading routing dump " + path);
  require(!out.empty(), ErrorCode::invalid_argument, "routing dump " + path + " holds no epoch");
  return out;
}

}  // namespace moka::sched
