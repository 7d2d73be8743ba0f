# libFuzzer targets, built alone with clang: each fuzz/*_fuzz.cpp links one instrumented library of the
# sources the targets exercise. Those are core, io and text (all of them), and from the model module only the
# files that need nothing beyond core, io and parallel: the config parser, the tensor catalogue, the
# parameter accounting and the config -> plan bridge (with parallel/plan.cpp). A new model source is
# not picked up here on purpose; add it to the list once it builds without the rest of the engine.
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "MEMRA_FUZZ needs clang (configure with CXX=clang++ CC=clang)")
endif()
file(GLOB fuzz_srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/fuzz/*_fuzz.cpp)
file(GLOB core_srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/core/*.cpp)
file(GLOB io_srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/io/*.cpp)
file(GLOB text_srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/text/*.cpp)
set(model_srcs
    ${PROJECT_SOURCE_DIR}/src/model/step35_config.cpp
    ${PROJECT_SOURCE_DIR}/src/model/step35_weights.cpp
    ${PROJECT_SOURCE_DIR}/src/model/step35_stats.cpp
    ${PROJECT_SOURCE_DIR}/src/model/step35_plan.cpp
    ${PROJECT_SOURCE_DIR}/src/parallel/plan.cpp)
# The server's request parser and its plain request types (nothing of the engine).
set(serve_srcs ${PROJECT_SOURCE_DIR}/src/serve/openai.cpp ${PROJECT_SOURCE_DIR}/src/serve/request.cpp)

set(fuzz_flags -g -O1 -ffp-contract=off)
add_library(memra_fuzz_support STATIC ${core_srcs} ${io_srcs} ${text_srcs} ${model_srcs} ${serve_srcs})
target_include_directories(memra_fuzz_support PUBLIC ${PROJECT_SOURCE_DIR}/src ${NLOHMANN_JSON_INCLUDE}
                                                     ${TL_EXPECTED_INCLUDE} ${PCRE2_INCLUDE} ${UTF8PROC_INCLUDE})
# The library is instrumented for coverage and the sanitizers but carries no main (fuzzer-no-link).
target_compile_options(memra_fuzz_support PRIVATE ${fuzz_flags} -fsanitize=fuzzer-no-link,address,undefined)
target_link_libraries(memra_fuzz_support PUBLIC fmt::fmt Threads::Threads ${PCRE2_LIB} ${UTF8PROC_LIB})

foreach(src ${fuzz_srcs})
    get_filename_component(name ${src} NAME_WE)
    add_executable(${name} ${src})
    target_compile_options(${name} PRIVATE ${fuzz_flags} -fsanitize=fuzzer,address,undefined)
    target_link_options(${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_libraries(${name} PRIVATE memra_fuzz_support)
endforeach()
