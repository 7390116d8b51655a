# rlsdk_add_plugin(<name> SOURCES <files...> [LINK <libs...>])
#
# Builds one loadable rlhost plugin: a MODULE library that exports exactly one symbol,
# rlh_plugin_entry (version script), resolves every symbol at link time (--no-undefined, which
# proves it never links librlhost) and lands in the plugin folder. Used in-tree and, installed with
# the SDK, by out-of-tree plugins after find_package(rlsdk).
include_guard(GLOBAL)

set(_RLSDK_CMAKE_DIR ${CMAKE_CURRENT_LIST_DIR})

function(rlsdk_add_plugin name)
  cmake_parse_arguments(P "" "OUTPUT_DIR" "SOURCES;LINK" ${ARGN})
  add_library(${name} MODULE ${P_SOURCES})
  set_target_properties(${name} PROPERTIES
    PREFIX "lib"
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(P_OUTPUT_DIR)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${P_OUTPUT_DIR})
  elseif(DEFINED RLH_PLUGIN_BUILD_DIR)
    set_target_properties(${name} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${RLH_PLUGIN_BUILD_DIR})
  endif()
  if(TARGET rlsdk::sdk)
    target_link_libraries(${name} PRIVATE rlsdk::sdk)
  else()
    target_link_libraries(${name} PRIVATE rlh_sdk)
  endif()
  # In-tree plugins install into the host's plugin folder.
  if(DEFINED RLH_PLUGIN_INSTALL_DIR AND NOT P_OUTPUT_DIR)
    install(TARGETS ${name} LIBRARY DESTINATION ${RLH_PLUGIN_INSTALL_DIR})
  endif()
  if(P_LINK)
    target_link_libraries(${name} PRIVATE ${P_LINK})
  endif()
  # Sanitized builds leave runtime symbols to the executable's runtime, so --no-undefined
  # only applies to normal builds (where it is the proof that plugins never link librlhost).
  if(NOT RLH_SANITIZE)
    target_link_options(${name} PRIVATE -Wl,--no-undefined)
  endif()
  target_link_options(${name} PRIVATE
    -Wl,--version-script=${_RLSDK_CMAKE_DIR}/plugin.map)
  set_property(TARGET ${name} APPEND PROPERTY LINK_DEPENDS ${_RLSDK_CMAKE_DIR}/plugin.map)
endfunction()
