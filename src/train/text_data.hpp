// Training text: the English fortune-cookie collection of Debian's `fortunes` package
// (/usr/share/games/fortunes; scripts/fetch_data.sh installs it). Each file holds records
// separated by lines of a single '%'. Records are assigned to train or validation by a hash of
// their text, so the split does not depend on file order or on how much is loaded.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/model.hpp"

namespace moka::train {

struct TextSplit {
  std::vector<uint8_t> train, validation;  // byte-level tokens
  int64_t records = 0;
  std::vector<std::string> files;
};

// $MOKA_TEXT_DIR when set, else the fortunes package's folder.
std::string default_text_dir();

// Loads the fortune files of `dir` (sorted by name; *.dat index files and symlinks skipped).
// max_bytes > 0 stops after that many bytes of records (a slice for tests). One record in
// `validation_every` goes to validation.
TextSplit load_fortune_corpus(const std::string& dir, int64_t max_bytes = 0, int validation_every = 20);

// `batch` windows of seq+1 bytes at offsets drawn from (seed, step): the same batch for the
// same step on every run, so resumed training sees the same data.
Batch sample_batch(const std::vector<uint8_t>& text, int64_t batch, int64_t seq, uint64_t seed, int64_t step);

}  // namespace moka::train
