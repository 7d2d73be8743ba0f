# Micro-benchmarks (Google Benchmark): bench/*.cpp -> one executable each.
find_package(benchmark REQUIRED)
file(GLOB bench_srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/bench/*.cpp)
foreach(src ${bench_srcs})
    get_filename_component(name ${src} NAME_WE)
    add_executable(memra_bench_${name} ${src})
    target_compile_options(memra_bench_${name} PRIVATE ${MEMRA_HOST_FLAGS})
    target_link_libraries(memra_bench_${name} PRIVATE memra benchmark::benchmark)
endforeach()
