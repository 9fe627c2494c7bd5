// Copyright mstar-kv authors.
//
// The descriptor channel of `mstar-kv demo`: the demo re-execs itself once
// per role (toolkit::Child), connected by a Unix socketpair that carries
// length-prefixed frames (the SequenceInfo bytes) and a one-byte "done".
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mstar::kv::cli::demo {

// Frames: u32 little-endian length, then the bytes (at most 64 MiB).
// write_frame throws Error(kPeerFailure) when the other side is gone;
// read_frame throws Error(kPeerFailure) on EOF and Error(kTimeout) when no
// whole frame arrived within `timeout`.
void write_frame(int fd, const std::vector<std::uint8_t>& bytes);
std::vector<std::uint8_t> read_frame(int fd, std::chrono::milliseconds timeout,
                                     const std::string& peer);

// One byte each way for "done" / acknowledgements.
void write_byte(int fd, std::uint8_t b);
std::uint8_t read_byte(int fd, std::chrono::milliseconds timeout, const std::string& peer);

}  // namespace mstar::kv::cli::demo
