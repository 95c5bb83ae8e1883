//! `saga redis`: the fast path's keys.

use saga_consumer::ConfigProblem;
use saga_consumer::settings::RedisArgs;

use super::{ActorArgs, Cli};
use crate::AdminError;
use crate::audit::{self, Action};

impl Cli {
    /// `saga redis forget`: deletes every key of the fast path's namespace, recorded in the audit log.
    pub(super) async fn redis_forget(
        &self,
        redis: &RedisArgs,
        by: &ActorArgs,
    ) -> anyhow::Result<()> {
        let actor = by.actor()?;
        // Recorded in the audit log of the schema whose services use the namespace.
        let pool = self.pool().await?;
        let (redis_url, namespace) = (&redis.redis_url, &redis.namespace);
        let url = redis_url
            .as_deref()
            .filter(|u| !u.is_empty())
            .ok_or_else(|| {
                ConfigProblem::new("REDIS_URL", "is not set", "set it to redis://HOST:PORT/DB")
            })?;
        let mut settings = saga_consumer::settings::FastPathArgs::new(url);
        settings.redis.namespace = namespace.clone();
        let fast = saga_consumer::fast_path::FastPath::new(settings, &pool).await?;
        let action = Action::new("redis forget").on("namespace", fast.namespace());
        let work = async {
            fast.forget_namespace()
                .await
                .map_err(|e| AdminError::Redis {
                    doing: format!("deleting the keys of {}", fast.namespace()),
                    source: e,
                })
        };
        let deleted =
            audit::audited(&pool, &actor, action, work, |n| format!("deleted {n} keys")).await?;
        let report = serde_json::json!({ "namespace": fast.namespace(), "deleted": deleted });
        self.print(&report, || {
            format!("deleted {deleted} keys of namespace {}", fast.namespace())
        })
    }
}
