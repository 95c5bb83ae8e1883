//! `saga trace`: one saga across every service schema.

use saga_runtime::config::connect_postgres;
use saga_runtime::config::required_postgres_url;

use super::Cli;
use crate::table::{Table, one_line};
use crate::trace;

impl Cli {
    pub(super) async fn trace(
        &self,
        key: &str,
        tenant: Option<&str>,
        schemas: &[String],
    ) -> anyhow::Result<()> {
        // Every service schema is read by name: the database is enough, no schema needed.
        let url = required_postgres_url("DATABASE_URL", self.database.database_url.as_deref())?;
        let pool = connect_postgres("DATABASE_URL", url, None, 2).await?;
        let found = trace::trace(&pool, key, tenant, schemas).await?;
        self.print(&found, || {
            let mut t = Table::new(["at", "service", "what", "step", "status", "detail"]);
            for e in &found.events {
                t.row([
                    e.at.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
                    e.lane.clone(),
                    e.kind.as_str().to_owned(),
                    e.subject.clone(),
                    e.status.clone(),
                    e.detail.clone(),
                ]);
            }
            let unread = found
                .unread
                .iter()
                .map(|u| format!("\nnot read: {}", one_line(u, 200)))
                .collect::<String>();
            let cut = found
                .cut
                .iter()
                .map(|c| format!("\ncut: {}", one_line(c, 200)))
                .collect::<String>();
            let unindexed = found
                .unindexed
                .iter()
                .map(|u| format!("\nslow: {}", one_line(u, 200)))
                .collect::<String>();
            format!(
                "{}{} events of key {} in {} services{unread}{cut}{unindexed}",
                t.render(),
                found.events.len(),
                found.key,
                found.lanes.len()
            )
        })?;
        // What was read is shown; a list that could not be read makes it no complete answer, which a
        // script sees in the exit code. (A list cut at its bound was read: `cut:` says so.)
        if !found.unread.is_empty() {
            anyhow::bail!(
                "incomplete: {} list(s) could not be read (see `not read:`)",
                found.unread.len()
            );
        }
        Ok(())
    }
}
