// Copyright mstar-kv authors.
#include "testkit/ports.hpp"

#include <fstream>
#include <random>
#include <sstream>

namespace mstar::kv::testkit {

std::vector<std::string> tcp_listeners(int port) {
  std::vector<std::string> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream ss(line);
      std::string slot, local, remote, state;
      ss >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A = LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
      out.push_back(std::string(file).find('6') != std::string::npos ? "v6:" + local
                                                                       : local.substr(0, colon));
    }
  }
  return out;
}

bool tcp_port_listening(int port) { return !tcp_listeners(port).empty(); }

int pick_port() {
  std::random_device rd;
  std::mt19937 gen(rd());
  std::uniform_int_distribution<int> dist(20000, 29999);
  for (int i = 0; i < 100; ++i) {
    const int p = dist(gen);
    if (!tcp_port_listening(p)) return p;
  }
  return dist(gen);
}

}  // namespace mstar::kv::testkit
