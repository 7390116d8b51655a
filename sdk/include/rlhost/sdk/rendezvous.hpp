// A bounded rendezvous over TCP for env launches (torchrun's MASTER_ADDR / MASTER_PORT): every
// rank sends one small blob to rank 0, which answers each with all of them (static library
// rlh_parallel). It is how a communicator without an MPI runtime meets its peers (comm_nccl
// exchanges its ncclUniqueId and each rank's GPU through it) and where a mismatched world shows:
// a rank that does not come, or says the world has another size, fails every rank within the
// timeout with a one-line error naming it, instead of a hang.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace rlh::sdk {

struct RendezvousOptions {
  std::string addr;  // rank 0's host name or address; rank 0 listens on every interface
  int port = 0;      // TCP port (MASTER_PORT)
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{30000};
  // Names this exchange ("comm_nccl world"); a rank of another exchange on the same port is
  // refused with both names.
  std::string tag;
};

// Every rank's blob (at most 1 MiB each), indexed by rank; the same on every rank. Throws
// rlh::sdk::Error:
//   DEADLINE_EXCEEDED  rank 0: "rendezvous 'tag' at host:port: ranks 2, 3 of 4 did not arrive
//                      within 30 s" (the connected ranks receive the same line); other ranks:
//                      that line, or "... rank 0 did not answer within 30 s" when it never did
//   INVALID_ARGUMENT   ranks disagree on the world size or the tag (naming both), a rank number
//                      twice, bad options
//   UNAVAILABLE        rank 0 cannot listen on the port (naming it and the system's reason)
std::vector<std::string> rendezvous_all_gather(const RendezvousOptions& options, const std::string& mine);

}  // namespace rlh::sdk
