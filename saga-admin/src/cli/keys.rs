//! `saga keys` and `saga leases`: step keys, held keys, two-phase leases.

use clap::Subcommand;

use super::{ActorArgs, Cli};
use crate::audit::{self, Action};
use crate::duration;
use crate::table::Table;
use crate::{holds, keys};

#[derive(Debug, Subcommand)]
pub(super) enum KeysCommand {
    /// Every step key derived from a client's key (status, attempts, lease, outcome), the HTTP key too.
    Show {
        /// The client's idempotency key.
        key: String,
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Keys held for a consumer group (a dead letter at their head, or a paused step), oldest first: their
    /// state, what holds them, the messages parked behind them, and for how long.
    Held {
        /// Only this consumer group's.
        #[arg(long)]
        group: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Release a held key by hand: its parked messages run in order, as if its head letter had been
    /// discarded (the letter stays in its topic). For a key whose head cannot be replayed or discarded.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["key", "key_hex"])))]
    Release {
        /// The key, as plain text (its UTF-8 bytes).
        key: Option<String>,
        /// The key's exact bytes in hexadecimal, as `saga keys held --json` gives them (`key_hex`): for a
        /// key that is not plain text (a zero byte, bytes that are not UTF-8).
        #[arg(long = "key-hex", value_parser = parse_key_hex)]
        key_hex: Option<KeyHex>,
        /// The consumer group that holds it.
        #[arg(long)]
        group: String,
        #[command(flatten)]
        by: ActorArgs,
    },
}

/// A key's exact bytes, given in hexadecimal (`--key-hex`).
#[derive(Debug, Clone)]
pub(super) struct KeyHex(Vec<u8>);

/// `--key-hex`: a key's bytes in hexadecimal.
fn parse_key_hex(text: &str) -> Result<KeyHex, String> {
    // An unset variable must not name the keyless messages' hold: that one is named as the key `''`.
    if text.trim().is_empty() {
        return Err(
            "is empty (the hold of a paused step's messages without a key is released with `saga keys \
             release ''`)"
                .to_owned(),
        );
    }
    saga_runtime::cli::parse_hex(text)
        .map(KeyHex)
        .ok_or_else(|| {
            "not hexadecimal (two digits a byte, as `saga keys held --json` gives key_hex)"
                .to_owned()
        })
}

fn keys_table(found: &[keys::KeyView]) -> String {
    let mut t = Table::new([
        "tenant",
        "step key",
        "status",
        "attempts",
        "lease holder",
        "lease expires",
        "outcome / error",
        "updated",
        "external key",
    ]);
    for k in found {
        t.row([
            k.tenant.clone(),
            k.step_key.clone(),
            if k.lease_expired {
                "started (lease expired)".to_owned()
            } else {
                k.status.clone()
            },
            k.attempts.to_string(),
            k.lease_holder.clone().unwrap_or_default(),
            k.lease_expires_at
                .map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
                .unwrap_or_default(),
            k.error
                .clone()
                .or_else(|| k.outcome.as_ref().map(ToString::to_string))
                .unwrap_or_default(),
            k.updated_at.format("%Y-%m-%d %H:%M:%S").to_string(),
            k.external_key.clone(),
        ]);
    }
    format!("{}{} keys", t.render(), found.len())
}

impl Cli {
    /// `saga leases`: two-phase leases (`expired`: those that ran out), at most `limit`.
    pub(super) async fn leases(&self, expired: bool, limit: i64) -> anyhow::Result<()> {
        let pool = self.pool().await?;
        let found = keys::leases(&pool, expired, limit).await?;
        self.print(&found, || keys_table(&found))
    }

    /// `saga keys …`.
    pub(super) async fn keys(&self, command: &KeysCommand) -> anyhow::Result<()> {
        match command {
            KeysCommand::Held { group, limit } => {
                let pool = self.pool().await?;
                let found = holds::list(&pool, group.as_deref(), *limit).await?;
                self.print(&found, || {
                    let mut t = Table::new([
                        "group",
                        "key",
                        "state",
                        "held by",
                        "parked",
                        "held for",
                        "head letter",
                    ]);
                    for h in &found {
                        t.row([
                            h.group.clone(),
                            h.key.clone(),
                            h.state.clone(),
                            h.held_by(),
                            h.parked.to_string(),
                            duration::human(std::time::Duration::from_secs(
                                h.age_seconds.max(0) as u64
                            )),
                            h.head
                                .as_ref()
                                .map(|(t, p, o)| format!("{t}/{p}/{o}"))
                                .unwrap_or_default(),
                        ]);
                    }
                    format!(
                        "{}{} held keys (replay or discard a head letter to release its key; \
                         `saga steps resume` releases a paused step's)",
                        t.render(),
                        found.len()
                    )
                })
            }
            KeysCommand::Release {
                key,
                key_hex,
                group,
                by,
            } => {
                let actor = by.actor()?;
                let operator = &actor.operator;
                let pool = self.pool().await?;
                let bytes = key_hex
                    .as_ref()
                    .map(|k| k.0.clone())
                    .or_else(|| key.as_ref().map(|k| k.as_bytes().to_vec()))
                    .unwrap_or_default();
                let action = Action::new("keys release")
                    .on("group", group)
                    .on_bytes("key", &bytes);
                let work = holds::release(&pool, group, &bytes, operator);
                let released = audit::audited(&pool, &actor, action, work, |r| {
                    format!("released; {} parked messages run in order", r.parked)
                })
                .await?;
                self.print(&released, || {
                    format!(
                        "key {} of group {} released by {operator}: its {} parked messages run in order",
                        released.key, released.group, released.parked
                    )
                })
            }
            KeysCommand::Show { key, tenant } => {
                let pool = self.pool().await?;
                let found = keys::show(&pool, key, tenant.as_deref()).await?;
                self.print(&found, || keys_table(&found))
            }
        }
    }
}
