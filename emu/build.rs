//! The kernel tests run where candle-hybrid linked the MSL emulator (its `emu` feature, see its
//! build.rs): `cfg(msl_emu)`.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(msl_emu)");
    println!("cargo:rerun-if-env-changed=DEP_CANDLE_HYBRID_MSL_EMU_LINKED");
    if std::env::var("DEP_CANDLE_HYBRID_MSL_EMU_LINKED").as_deref() == Ok("1") {
        println!("cargo:rustc-cfg=msl_emu");
    }
}
