// What keeps strangers out of a job's rendezvous (tcp_group.cpp): a secret every rank holds (the
// job key), a fresh challenge from rank 0 per connection, HMAC-SHA256 proofs (OpenSSL), and text
// from peers made safe to print.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace moka::comm {

using Digest = std::array<uint8_t, 32>;

// `count` bytes from the operating system's random source (OpenSSL's RAND_bytes).
std::vector<uint8_t> random_bytes(size_t count);
// 32 random bytes as 64 hex digits: a job key (`moka launch` makes one per job).
std::string random_key();
// HMAC-SHA256(key, message).
Digest hmac_sha256(const std::string& key, const std::vector<uint8_t>& message);
// Equal digests, in time that does not depend on where they differ.
bool digests_equal(const Digest& a, const Digest& b);

// Whether `addr` (an IPv4 address or a host name) resolves to this machine's loopback only.
bool is_loopback(const std::string& addr);

// `text` with every control character (and byte >= 0x7f) written as \xNN, at most `max_bytes`
// of it: what a peer sent, safe to print on a terminal.
std::string printable(const std::string& text, size_t max_bytes = 2048);

}  // namespace moka::comm
