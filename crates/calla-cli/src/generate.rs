//! `calla generate` (being built; see the issue tracker).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("calla generate is not built yet")
}
