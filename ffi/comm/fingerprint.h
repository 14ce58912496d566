// What every rank of a communicator must agree on, sent ahead of everything
// else at rendezvous. A mismatch fails connect() on every rank with a
// message saying what differs, instead of a hang or a wrong sum later.
#pragma once

#include <string>

#include "comm/endpoint.h"

namespace arx {

// This rank's fingerprint, as bytes.
std::string fingerprint(const EndpointSpec& spec);
// Checks rank j's fingerprint (the head of its details) against this rank's;
// "" when they agree, else the sentence that says what differs. `rest`: the
// details after the fingerprint.
std::string check_fingerprint(const EndpointSpec& mine, const std::string& details, int j, std::string& rest);

}  // namespace arx
