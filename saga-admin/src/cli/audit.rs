//! `saga audit`: the audit log.

use super::Cli;
use crate::audit;
use crate::duration;
use crate::table::Table;

impl Cli {
    /// `saga audit`: the actions of `operator` and `action` within `since`, newest first.
    pub(super) async fn audit(
        &self,
        operator: &Option<String>,
        action: &Option<String>,
        since: Option<&str>,
        limit: i64,
    ) -> anyhow::Result<()> {
        let mut filter = audit::AuditFilter::default();
        filter.operator.clone_from(operator);
        filter.action.clone_from(action);
        filter.since = since.map(duration::parse).transpose()?;
        filter.limit = limit;
        let found = audit::list(&self.pool().await?, &filter).await?;
        self.print(&found, || {
            let mut t = Table::new([
                "#", "at", "operator", "via", "action", "target", "outcome", "reason", "detail",
            ]);
            for e in &found {
                t.row([
                    e.id.to_string(),
                    e.at.format("%Y-%m-%d %H:%M:%S").to_string(),
                    e.operator.clone(),
                    e.via.clone(),
                    e.action.clone(),
                    e.target_text(),
                    e.outcome.clone(),
                    e.reason.clone().unwrap_or_default(),
                    e.detail.clone().unwrap_or_default(),
                ]);
            }
            format!("{}{} actions", t.render(), found.len())
        })
    }
}
