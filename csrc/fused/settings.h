// The C++ side's runtime settings (fastmesh/settings.py documents every one): read from the environment once, on
// first use, and again when Python reloads its settings (fastmesh.settings.reload()), never per call. A bad value is
// an error naming the variable when the setting is used.
#pragma once

namespace fastmesh {
namespace fused {

enum class Transport { kAuto, kCollective, kPointToPoint };

// FASTMESH_TRANSPORT: how the fused ops move their pieces ("auto", "collective", "p2p"; process_group.h).
Transport transport_setting();

// FASTMESH_SHAPE_CHECK=every: the cross-rank shape check on every call ("first" or "every").
bool shape_check_every_call_setting();

// Reads the environment again.
void reload_settings();

}  // namespace fused
}  // namespace fastmesh
