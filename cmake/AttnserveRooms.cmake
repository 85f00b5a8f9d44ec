# The server's rooms (server/<room>/), each a static library that links only the rooms beneath it.
# A room's headers are reachable only through an include directory of its own under the build tree,
# holding one link, server/<room> -> the source folder; a room's include directory travels to the
# rooms above it with its PUBLIC link. So `#include "server/<room>/..."` of a room above (or beside)
# fails to compile: the layering is enforced by the compiler, not by review.
#
#   attnserve_room(<room> SOURCES <file>... [BELOW <target>...] [PUBLIC <target>...]
#                  [PRIVATE <target>...])
#     BELOW:   the rooms beneath it that it uses (linked PUBLIC: their headers are part of its own)
#     PUBLIC/PRIVATE: other libraries
function(attnserve_room room)
  cmake_parse_arguments(PARSE_ARGV 1 R "" "" "SOURCES;BELOW;PUBLIC;PRIVATE")
  set(dir ${PROJECT_BINARY_DIR}/rooms/${room})
  file(MAKE_DIRECTORY ${dir}/server)
  if(NOT EXISTS ${dir}/server/${room})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/server/${room} ${dir}/server/${room} SYMBOLIC)
  endif()
  add_library(attnserve_${room} STATIC ${R_SOURCES})
  add_library(attnserve::${room} ALIAS attnserve_${room})
  target_include_directories(attnserve_${room} PUBLIC ${dir})
  target_link_libraries(attnserve_${room} PUBLIC ${R_BELOW} ${R_PUBLIC} PRIVATE ${R_PRIVATE})
endfunction()
