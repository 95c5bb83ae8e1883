//! `saga inspect`: the inspector page.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Args;
use saga_consumer::ConfigProblem;

use super::Cli;
use crate::inspect::{self, InspectOptions};

/// Serve the inspector page (`saga inspect`).
#[derive(Debug, Args)]
pub(super) struct InspectArgs {
    /// Where to listen (localhost by default). Anywhere else needs a token (SAGA_ADMIN_TOKEN, or
    /// SAGA_ADMIN_TOKENS=name:token,…), or --insecure-no-token.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// What the page shows, and who may drive it.
    #[command(flatten)]
    options: InspectOptions,
    /// Listen beyond localhost, or serve under a --public-name, without a token: anyone who reaches the
    /// page may replay dead letters.
    #[arg(long)]
    insecure_no_token: bool,
    #[command(flatten)]
    tokens: TokenArgs,
}

/// The inspector's tokens: read from the environment (kept off the command line, where other users of the
/// machine could read them).
#[derive(Debug, Args)]
#[group(id = "saga_admin_tokens")]
pub(super) struct TokenArgs {
    /// A token every request of the page and its API must present (named `admin`); required to listen
    /// beyond localhost (or SAGA_ADMIN_TOKENS).
    #[arg(
        long = "admin-token",
        env = "SAGA_ADMIN_TOKEN",
        hide = true,
        hide_env_values = true
    )]
    token: Option<String>,
    /// Named tokens, `name:token,…`: the name is recorded as the operator of what its holder does.
    #[arg(
        long = "admin-tokens",
        env = "SAGA_ADMIN_TOKENS",
        hide = true,
        hide_env_values = true
    )]
    tokens: Option<String>,
}

/// The inspector's tokens: `SAGA_ADMIN_TOKENS` (`name:token,…`) and `SAGA_ADMIN_TOKEN` (named `admin`).
fn inspector_tokens(args: &TokenArgs) -> Result<Vec<inspect::NamedToken>, ConfigProblem> {
    let mut tokens = Vec::new();
    if let Some(list) = &args.tokens {
        tokens = inspect::NamedToken::parse_list(list).map_err(|e| {
            ConfigProblem::new("SAGA_ADMIN_TOKENS", e, "write name:token,name:token")
        })?;
    }
    if let Some(token) = args.token.as_deref()
        && !token.is_empty()
    {
        tokens.push(
            inspect::NamedToken::new("admin", token).map_err(|e| {
                ConfigProblem::new("SAGA_ADMIN_TOKEN", e, "use a longer random token")
            })?,
        );
    }
    Ok(tokens)
}

impl Cli {
    /// Serve the inspector page (`saga inspect`).
    pub(super) async fn inspect(&self, args: &InspectArgs) -> anyhow::Result<()> {
        let InspectArgs {
            listen,
            options,
            insecure_no_token,
            tokens,
        } = args;
        let public_names = &options.public_names;
        let tokens = inspector_tokens(tokens)?;
        // Served to others: listening beyond localhost, or named as a proxy in front serves it.
        let served_to_others = if !listen.ip().is_loopback() {
            Some(format!(
                "the inspector would listen beyond localhost ({listen})"
            ))
        } else {
            (!public_names.is_empty()).then(|| {
                format!(
                    "the inspector would be served to others under --public-name {}",
                    public_names.join(", ")
                )
            })
        };
        if let Some(why) = served_to_others.filter(|_| tokens.is_empty() && !insecure_no_token) {
            return Err(ConfigProblem::new(
                        "SAGA_ADMIN_TOKEN",
                        format!("is not set, and {why}"),
                        "set SAGA_ADMIN_TOKEN (or SAGA_ADMIN_TOKENS=name:token,...), or pass --insecure-no-token",
                    )
                    .into());
        }
        let mut options = options.clone();
        options.tokens = tokens;
        let (kafka, pool) = (self.kafka().await?, self.pool().await?);
        let listener = std::net::TcpListener::bind(listen)
            .with_context(|| format!("listening on {listen}"))?;
        println!("inspector on http://{}/", listener.local_addr()?);
        inspect::serve(
            listener,
            kafka,
            pool,
            options,
            saga_runtime::shutdown::wait_for_signal(),
        )
        .await?;
        Ok(())
    }
}
