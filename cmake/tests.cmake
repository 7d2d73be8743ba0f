# Tests: one GoogleTest executable per folder of tests/ (linking only the module it tests, so the
# link graph keeps module boundaries honest), the oracle tools, and the Python oracle suites.
find_package(GTest REQUIRED)
include(GoogleTest)

# memra_test_dir(DIR LIBS... [EXCLUDE FILE...]): tests/DIR/*.cpp, less the EXCLUDE files (names in DIR) that
# another executable builds, -> memra_DIR_tests, registered with CTest.
function(memra_test_dir dir)
    cmake_parse_arguments(T "" "" "EXCLUDE" ${ARGN})
    file(GLOB srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/${dir}/*.cpp)
    foreach(excluded ${T_EXCLUDE})
        list(REMOVE_ITEM srcs ${PROJECT_SOURCE_DIR}/tests/${dir}/${excluded})
    endforeach()
    if(NOT srcs)
        return()
    endif()
    add_executable(memra_${dir}_tests ${srcs})
    target_compile_options(memra_${dir}_tests PRIVATE ${MEMRA_HOST_FLAGS})
    target_include_directories(memra_${dir}_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests ${CLI11_INCLUDE})
    target_link_libraries(memra_${dir}_tests PRIVATE ${T_UNPARSED_ARGUMENTS} GTest::gtest GTest::gtest_main)
    target_compile_definitions(memra_${dir}_tests PRIVATE
        MEMRA_SOURCE_DIR="${PROJECT_SOURCE_DIR}" MEMRA_BINARY_DIR="${PROJECT_BINARY_DIR}"
        MEMRA_EXE="$<TARGET_FILE:memra_cli>")
    gtest_discover_tests(memra_${dir}_tests DISCOVERY_TIMEOUT 60 PROPERTIES LABELS unit)
endfunction()

memra_test_dir(core memra_core)
memra_test_dir(io memra_io)
memra_test_dir(parallel memra_parallel EXCLUDE test_mpi_comm.cpp)
memra_test_dir(kv memra_kv)
memra_test_dir(cpu memra_cpu)
memra_test_dir(text memra_text)
target_compile_options(memra_text_tests PRIVATE ${MEMRA_NO_FALSE_RESTRICT})
memra_test_dir(runtime memra_runtime memra_tools memra_cpu)
memra_test_dir(model memra_model memra_tools memra_cpu)
memra_test_dir(tools memra_tools)
memra_test_dir(serve memra_serve memra_tools memra_cpu)
memra_test_dir(cli memra)
if(TARGET memra_cli_tests)
    add_dependencies(memra_cli_tests memra_cli default_model)
    # test_run_guarded.cpp calls the CLI's run_guarded directly; the rest of the suite runs the binary.
    target_sources(memra_cli_tests PRIVATE ${PROJECT_SOURCE_DIR}/src/cli/common.cpp ${PROJECT_SOURCE_DIR}/src/cli/progress.cpp
                                           ${PROJECT_SOURCE_DIR}/src/cli/launch.cpp)
    if(MEMRA_HAVE_MPI)  # the multi-process launch's tests run `mpirun -np 2 memra ...`
        target_compile_definitions(memra_cli_tests PRIVATE MEMRA_MPIEXEC="${MPIEXEC_EXECUTABLE}")
    endif()
endif()
add_dependencies(memra_text_tests memra_cli)  # its tiny-tokenizer suite runs `memra make-tiny`
if(MEMRA_HAVE_CUDA)
    memra_test_dir(cuda memra_cuda memra_cpu memra_runtime)
endif()

# The MPI communicator's tests run as 4 processes under mpirun (one CTest test; the executable has its own
# main, which prints gtest's report on rank 0 only and the failures of every rank). CI runs as root, which
# Open MPI refuses unless told; vader's single-copy path (CMA) needs ptrace rights a container may lack.
if(MEMRA_HAVE_MPI)
    add_executable(memra_mpi_tests ${PROJECT_SOURCE_DIR}/tests/parallel/test_mpi_comm.cpp)
    target_compile_options(memra_mpi_tests PRIVATE ${MEMRA_HOST_FLAGS})
    target_include_directories(memra_mpi_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests)
    target_link_libraries(memra_mpi_tests PRIVATE memra_mpi GTest::gtest)
    set(memra_mpi_flags)
    if(MPI_C_LIBRARY_VERSION_STRING MATCHES "Open MPI")
        set(memra_mpi_flags --oversubscribe)  # 4 processes on a machine of fewer cores
    endif()
    add_test(NAME parallel.mpi_4_processes
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} 4 ${memra_mpi_flags} ${MPIEXEC_PREFLAGS}
                     $<TARGET_FILE:memra_mpi_tests> ${MPIEXEC_POSTFLAGS})
    set(memra_mpi_env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        OMPI_MCA_btl_vader_single_copy_mechanism=none)
    if(MEMRA_SANITIZE)  # Open MPI's own leaks, suppressed by library (mpi_lsan.supp says why)
        list(APPEND memra_mpi_env ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0
             LSAN_OPTIONS=suppressions=${PROJECT_SOURCE_DIR}/tests/parallel/mpi_lsan.supp:print_suppressions=0)
    endif()
    set_tests_properties(parallel.mpi_4_processes PROPERTIES
        LABELS unit TIMEOUT 120 PROCESSORS 4 ENVIRONMENT "${memra_mpi_env}")
endif()

# Oracle tools: small executables the Python suites drive (tests/oracle/*_tool.cpp).
file(GLOB tool_srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/oracle/*_tool.cpp)
set(MEMRA_ORACLE_TOOLS)
foreach(src ${tool_srcs})
    get_filename_component(name ${src} NAME_WE)
    add_executable(memra_${name} ${src})
    target_compile_options(memra_${name} PRIVATE ${MEMRA_HOST_FLAGS})
    target_link_libraries(memra_${name} PRIVATE memra)
    list(APPEND MEMRA_ORACLE_TOOLS memra_${name})
endforeach()

# Python oracle suites (ml_dtypes, gguf, safetensors, tokenizers), run from the project's venv.
set(MEMRA_PYTHON ${PROJECT_SOURCE_DIR}/.venv/bin/python CACHE FILEPATH "Python with the oracle packages")
# The model oracles (transformers with its Step-3.5 text model, llama.cpp: requirements-oracle.txt) are
# registered only when the venv has them; CMake says so loudly when it does not, and fails with
# MEMRA_REQUIRE_ORACLES (CI). The probe imports transformers.models.step3p7 itself: an older transformers
# imports fine but lacks the model, and its suites would only skip.
option(MEMRA_REQUIRE_ORACLES "Fail configuration without the model oracles, and fail an oracle test that skips" OFF)
set(memra_heavy_oracle_tests test_hf_oracle test_engine_oracle test_bench_vs_llamacpp test_perplexity test_default_model
    test_train_export)
set(memra_heavy_oracles "torch / transformers with transformers.models.step3p7 / llama_cpp")
execute_process(COMMAND ${MEMRA_PYTHON} -c "import torch, transformers, transformers.models.step3p7, llama_cpp"
                RESULT_VARIABLE memra_heavy_oracles_missing OUTPUT_QUIET ERROR_VARIABLE memra_heavy_oracles_error)
if(memra_heavy_oracles_missing)
    # The last line of the traceback names what failed to import.
    string(STRIP "${memra_heavy_oracles_error}" memra_heavy_oracles_error)
    string(REGEX REPLACE ".*\n" "" memra_heavy_oracles_error "${memra_heavy_oracles_error}")
    if(NOT memra_heavy_oracles_error)
        set(memra_heavy_oracles_error "${memra_heavy_oracles_missing}")  # the python itself did not run
    endif()
endif()
if(memra_heavy_oracles_missing AND MEMRA_REQUIRE_ORACLES)
    message(FATAL_ERROR "${memra_heavy_oracles} are not all in ${MEMRA_PYTHON} (${memra_heavy_oracles_error}): "
                        "run scripts/setup.sh (MEMRA_REQUIRE_ORACLES is on)")
endif()
# Under MEMRA_REQUIRE_ORACLES every oracle suite runs with MEMRA_REQUIRE_ORACLES=1, which
# tests/oracle/conftest.py reads to turn any skip (a module-level importorskip included) into a failure.
set(memra_oracle_env "MEMRA_BUILD_DIR=${PROJECT_BINARY_DIR}" "MEMRA_EXE=$<TARGET_FILE:memra_cli>")
if(MEMRA_REQUIRE_ORACLES)
    list(APPEND memra_oracle_env "MEMRA_REQUIRE_ORACLES=1")
endif()
file(GLOB py_tests CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/oracle/test_*.py)
foreach(py ${py_tests})
    get_filename_component(name ${py} NAME_WE)
    if(name IN_LIST memra_heavy_oracle_tests AND memra_heavy_oracles_missing)
        message(WARNING "oracle.${name} not registered: ${memra_heavy_oracles} are not all in "
                        "${MEMRA_PYTHON} (${memra_heavy_oracles_error}; scripts/setup.sh installs "
                        "requirements-oracle.txt)")
        continue()
    endif()
    add_test(NAME oracle.${name}
             COMMAND ${MEMRA_PYTHON} -m pytest -q -p no:cacheprovider ${py}
             WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
    set_tests_properties(oracle.${name} PROPERTIES LABELS oracle ENVIRONMENT "${memra_oracle_env}")
endforeach()
