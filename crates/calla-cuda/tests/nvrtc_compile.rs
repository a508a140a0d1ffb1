//! Every kernel source compiles under NVRTC for sm_90a. Needs only libnvrtc (no GPU): CI installs the
//! `nvidia-cuda-nvrtc==13.0.*` wheel and runs this with LD_LIBRARY_PATH at its lib directory
//! (scripts/ci-nvrtc-check.sh). Without NVRTC it is skipped unless CALLA_REQUIRE_NVRTC=1.

#[test]
fn every_kernel_compiles_for_sm_90a() {
    if let Err(e) = calla_cuda::runtime::probe::nvrtc_library() {
        if std::env::var("CALLA_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("{e:#}");
        }
        eprintln!("skipped: {e:#}");
        return;
    }
    match calla_cuda::runtime::nvrtc::compile_all("sm_90a") {
        Ok(lines) => {
            for l in lines {
                println!("{l}");
            }
        }
        Err(e) => panic!("{e:#}"),
    }
}
