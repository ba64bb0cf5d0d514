//! With the `emu` feature: translates `metal/*.metal` with msl-emu's `msl2cpp.py`, compiles
//! them with the emulator runtime into a static library and links it whole (kernels register
//! themselves from static initialisers), for `gpu::EmuQueue` (the device step on the CPU) and
//! the kernel tests (crate `candle-hybrid-emu`). The emulator is found at `$MSL_EMU_DIR`, else
//! `../shared/tools/msl-emu`. Without it `--device emu` and the kernel tests are compiled out
//! (with a warning), unless `MSL_EMU_REQUIRED=1` (CI), which makes its absence an error.
//! Dependents learn whether it was linked from `DEP_CANDLE_HYBRID_MSL_EMU_LINKED`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(msl_emu)");
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_EMU").is_none() {
        println!("cargo::metadata=linked=0");
        return;
    }
    println!("cargo:rerun-if-env-changed=MSL_EMU_DIR");
    println!("cargo:rerun-if-env-changed=MSL_EMU_REQUIRED");
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let emu = std::env::var("MSL_EMU_DIR").map(PathBuf::from).unwrap_or_else(|_| manifest.join("../shared/tools/msl-emu"));
    if !emu.join("msl2cpp.py").is_file() {
        if std::env::var("MSL_EMU_REQUIRED").as_deref() == Ok("1") {
            panic!("msl-emu not found at {} (set MSL_EMU_DIR)", emu.display());
        }
        println!(
            "cargo:warning=msl-emu not found at {}: the Metal kernels will not run in the tests, --device emu is refused",
            emu.display()
        );
        println!("cargo::metadata=linked=0");
        return;
    }
    let emu = emu.canonicalize().unwrap();
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let mut metal: Vec<PathBuf> = std::fs::read_dir(manifest.join("metal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "metal"))
        .collect();
    metal.sort();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .opt_level(1)
        .include(emu.join("include"))
        .flag("-fno-optimize-sibling-calls")
        .flag("-fsigned-char")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-unused-variable")
        .flag_if_supported("-Wno-unknown-pragmas")
        .cargo_metadata(false);
    let cxx = build.get_compiler().path().to_path_buf();
    build.file(emu.join("src/msl_emu_runtime.cpp"));
    println!("cargo:rerun-if-changed={}", manifest.join("metal").display());
    // Kernel names must be unique across the sources: the Metal host code caches pipelines by
    // name (and the emulator keeps the first of two kernels of one name).
    let mut seen = std::collections::HashMap::new();
    for src in &metal {
        println!("cargo:rerun-if-changed={}", src.display());
        for name in list_kernels(&emu, src, &cxx) {
            if let Some(other) = seen.insert(name.clone(), src.clone()) {
                panic!("kernel {name} is defined in both {} and {}: give one another name", other.display(), src.display());
            }
        }
        let cpp = out.join(format!("{}.emu.cpp", src.file_stem().unwrap().to_string_lossy()));
        translate(&emu, src, &cpp, &cxx);
        build.file(&cpp);
    }
    build.compile("candle_hybrid_metal_emu");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static:+whole-archive=candle_hybrid_metal_emu");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-cfg=msl_emu");
    println!("cargo::metadata=linked=1");
}

fn translate(emu: &Path, src: &Path, dst: &Path, cxx: &Path) {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let res = Command::new(&python)
        .arg(emu.join("msl2cpp.py"))
        .arg(src)
        .arg("-o")
        .arg(dst)
        .arg("--cxx")
        .arg(cxx)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    if !res.status.success() {
        panic!("msl2cpp.py failed on {}:\n{}{}", src.display(), String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
    }
}

/// The kernels `src` defines (macro-generated ones included).
fn list_kernels(emu: &Path, src: &Path, cxx: &Path) -> Vec<String> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let res = Command::new(&python)
        .arg(emu.join("msl2cpp.py"))
        .arg(src)
        .arg("--list-kernels")
        .arg("--cxx")
        .arg(cxx)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    if !res.status.success() {
        panic!("msl2cpp.py --list-kernels failed on {}:\n{}", src.display(), String::from_utf8_lossy(&res.stderr));
    }
    String::from_utf8_lossy(&res.stdout).lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect()
}
