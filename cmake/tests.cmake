# Tests: one GoogleTest executable per folder of tests/ (linking only the module it tests, so the
# link graph keeps module boundaries honest), the oracle tools, and the Python oracle suites.
find_package(GTest REQUIRED)
include(GoogleTest)

# memra_test_dir(DIR LIBS...): tests/DIR/*.cpp -> memra_DIR_tests, registered with CTest.
function(memra_test_dir dir)
    file(GLOB srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/${dir}/*.cpp)
    if(NOT srcs)
        return()
    endif()
    add_executable(memra_${dir}_tests ${srcs})
    target_compile_options(memra_${dir}_tests PRIVATE ${MEMRA_HOST_FLAGS})
    target_include_directories(memra_${dir}_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests ${CLI11_INCLUDE})
    target_link_libraries(memra_${dir}_tests PRIVATE ${ARGN} GTest::gtest GTest::gtest_main)
    target_compile_definitions(memra_${dir}_tests PRIVATE
        MEMRA_SOURCE_DIR="${PROJECT_SOURCE_DIR}" MEMRA_BINARY_DIR="${PROJECT_BINARY_DIR}"
        MEMRA_EXE="$<TARGET_FILE:memra_cli>")
    gtest_discover_tests(memra_${dir}_tests DISCOVERY_TIMEOUT 60 PROPERTIES LABELS unit)
endfunction()

memra_test_dir(core memra_core)
memra_test_dir(io memra_io)
memra_test_dir(parallel memra_parallel)
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
    target_sources(memra_cli_tests PRIVATE ${PROJECT_SOURCE_DIR}/src/cli/common.cpp ${PROJECT_SOURCE_DIR}/src/cli/progress.cpp)
endif()
add_dependencies(memra_text_tests memra_cli)  # its tiny-tokenizer suite runs `memra make-tiny`
if(MEMRA_HAVE_CUDA)
    memra_test_dir(cuda memra_cuda memra_cpu memra_runtime)
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
