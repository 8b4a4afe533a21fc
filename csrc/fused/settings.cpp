#include "settings.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kTransportVariable = "FASTMESH_TRANSPORT";
constexpr const char* kShapeCheckVariable = "FASTMESH_SHAPE_CHECK";

struct Settings {
  Transport transport = Transport::kAuto;
  bool shape_check_every_call = false;
  std::string transport_error, shape_check_error;  // non-empty: the variable's value is not one it takes
};

std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

Settings read() {
  Settings settings;
  const std::string transport = environment(kTransportVariable);
  if (transport == "collective") {
    settings.transport = Transport::kCollective;
  } else if (transport == "p2p") {
    settings.transport = Transport::kPointToPoint;
  } else if (!transport.empty() && transport != "auto") {
    settings.transport_error = std::string(kTransportVariable) +
                               " (how the fused ops move their pieces) must be \"auto\", \"collective\" or \"p2p\", "
                               "got \"" +
                               transport + '"';
  }
  const std::string check = environment(kShapeCheckVariable);
  if (check == "every") {
    settings.shape_check_every_call = true;
  } else if (!check.empty() && check != "first") {
    settings.shape_check_error = std::string(kShapeCheckVariable) +
                                 " (when the fused ops compare shapes across ranks) must be \"first\" or \"every\", "
                                 "got \"" +
                                 check + '"';
  }
  return settings;
}

std::mutex settings_mutex;

Settings& current() {
  static Settings settings = read();
  return settings;
}

}  // namespace

Transport transport_setting() {
  std::lock_guard<std::mutex> lock(settings_mutex);
  const Settings& settings = current();
  TORCH_CHECK_VALUE(settings.transport_error.empty(), settings.transport_error);
  return settings.transport;
}

bool shape_check_every_call_setting() {
  std::lock_guard<std::mutex> lock(settings_mutex);
  const Settings& settings = current();
  TORCH_CHECK_VALUE(settings.shape_check_error.empty(), settings.shape_check_error);
  return settings.shape_check_every_call;
}

void reload_settings() {
  std::lock_guard<std::mutex> lock(settings_mutex);
  current() = read();
}

}  // namespace fused
}  // namespace fastmesh
