#include "train/step_profile.hpp"

#include <cstdio>

namespace moka::train {

const char* stage_name(Stage s) {
  static constexpr std::array<const char*, kStageCount> names{"embedding forward",   "norms forward",
                                                              "attention forward",   "MoE forward",
                                                              "head + loss forward", "head + loss backward",
                                                              "MoE backward",        "norms backward",
                                                              "attention backward",  "embedding backward",
                                                              "optimizer",           "EMA",
                                                              "router bias",         "inputs"};
  return names[size_t(s)];
}

nlohmann::json StepProfile::to_json() const {
  const double per = steps > 0 ? 1.0 / double(steps) : 0.0;
  nlohmann::json stages = nlohmann::json::array();
  for (int i = 0; i < kStageCount; ++i) {
    nlohmann::json s{{"stage", stage_name(Stage(i))}, {"ms_per_step", ms[i] * per}};
    if (launches_per_step >= 0) s["launches_per_step"] = launches[i];
    stages.push_back(std::move(s));
  }
  return {{"clock", clock},
          {"mode", mode},
          {"steps", steps},
          {"step_ms", step_ms * per},
          {"host_ms_per_step", host_ms * per},
          {"launches_per_step", launches_per_step},
          {"host_syncs_per_step", double(host_syncs) * per},
          {"stages", stages}};
}

std::string StepProfile::table() const {
  const double per = steps > 0 ? 1.0 / double(steps) : 0.0;
  double staged = 0;
  for (double v : ms) staged += v;
  std::string out;
  char line[160];
  std::snprintf(line, sizeof line, "profile: %lld steps, %s, %s\n%-22s %10s %7s %9s\n", (long long)steps, mode.c_str(),
                clock.c_str(), "stage", "ms/step", "share", "launches");
  out += line;
  for (int i = 0; i < kStageCount; ++i) {
    char launches_text[24] = "-";
    if (launches_per_step >= 0) std::snprintf(launches_text, sizeof launches_text, "%lld", (long long)launches[i]);
    std::snprintf(line, sizeof line, "%-22s %10.3f %6.1f%% %9s\n", stage_name(Stage(i)), ms[i] * per,
                  staged > 0 ? 100.0 * ms[i] / staged : 0.0, launches_text);
    out += line;
  }
  std::snprintf(line, sizeof line, "step: %.3f ms on the %s (stages sum %.3f), host %.3f ms; ", step_ms * per,
                clock.c_str(), staged * per, host_ms * per);
  out += line;
  if (launches_per_step >= 0) out += std::to_string(launches_per_step) + " launches, ";
  std::snprintf(line, sizeof line, "%.2f host syncs per step\n", double(host_syncs) * per);
  out += line;
  return out;
}

}  // namespace moka::train
