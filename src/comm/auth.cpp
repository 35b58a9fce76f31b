#include "comm/auth.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>

#include "moka/error.hpp"

namespace moka::comm {

std::vector<uint8_t> random_bytes(size_t count) {
  std::vector<uint8_t> out(count);
  require(RAND_bytes(out.data(), static_cast<int>(count)) == 1, ErrorCode::io,
          "no random bytes from the operating system (OpenSSL RAND_bytes failed)");
  return out;
}

std::string random_key() {
  std::string hex;
  for (uint8_t b : random_bytes(32)) {
    char two[3];
    std::snprintf(two, sizeof(two), "%02x", b);
    hex += two;
  }
  return hex;
}

Digest hmac_sha256(const std::string& key, const std::vector<uint8_t>& message) {
  Digest out{};
  unsigned int length = 0;
  require(HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), message.data(), message.size(), out.data(),
               &length) != nullptr &&
              length == out.size(),
          ErrorCode::internal, "HMAC-SHA256 failed");
  return out;
}

bool digests_equal(const Digest& a, const Digest& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

bool is_loopback(const std::string& addr) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (::getaddrinfo(addr.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool loopback = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const uint32_t ip = ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
    loopback = loopback && (ip >> 24) == 127;
  }
  ::freeaddrinfo(found);
  return loopback;
}

std::string printable(const std::string& text, size_t max_bytes) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max_bytes; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      out += escaped;
    }
  }
  if (text.size() > max_bytes) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

}  // namespace moka::comm
