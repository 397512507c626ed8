# RunLease moves from the dispatch app to this one without touching the
# database (docs/adr/0004): the table keeps its name, dispatch_runlease, and
# this migration only adds the model to the leases app's migration state.
# dispatch/migrations/0003 then removes it from dispatch's state.
#
# The content type is renamed too, so the permissions granted on leases
# (revoke_lease, view_runlease, ...) and the admin log keep pointing at them;
# on a fresh database there is nothing to rename yet.

import django.db.models.deletion
from django.db import migrations, models


def _move_content_type(apps, schema_editor, *, old: str, new: str):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    if not ContentType.objects.using(db).filter(app_label=new, model="runlease").exists():
        ContentType.objects.using(db).filter(app_label=old, model="runlease").update(app_label=new)


def forwards(apps, schema_editor):
    _move_content_type(apps, schema_editor, old="dispatch", new="leases")


def backwards(apps, schema_editor):
    _move_content_type(apps, schema_editor, old="leases", new="dispatch")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ('contenttypes', '0002_remove_content_type_name'),
        ('dispatch', '0002_admin_action_permissions'),
        ('runs', '0001_initial'),
        ('workers', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name='RunLease',
                    fields=[
                        ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                        ('session_generation', models.PositiveIntegerField()),
                        ('lease_generation', models.PositiveIntegerField()),
                        ('offer_id', models.CharField(max_length=64, unique=True)),
                        ('token_digest', models.CharField(max_length=64)),
                        ('spec_digest', models.CharField(max_length=64)),
                        ('placement_score', models.IntegerField(blank=True, null=True)),
                        ('source', models.CharField(choices=[('new_claim', 'New Claim'), ('pull_claim', 'Pull Claim')], max_length=16)),
                        ('pull_id', models.UUIDField(blank=True, null=True)),
                        ('state', models.CharField(choices=[('active', 'Active'), ('released', 'Released'), ('expired', 'Expired'), ('revoked', 'Revoked')], default='active', max_length=16)),
                        ('version', models.PositiveIntegerField(default=0)),
                        ('claimed_at', models.DateTimeField()),
                        ('expires_at', models.DateTimeField()),
                        ('delivery_count', models.PositiveIntegerField(default=0)),
                        ('last_delivered_at', models.DateTimeField(blank=True, null=True)),
                        ('ended_at', models.DateTimeField(blank=True, null=True)),
                        ('end_reason', models.CharField(blank=True, default='', max_length=48)),
                        ('attempt', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='leases', to='runs.attempt')),
                        ('run', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='leases', to='runs.run')),
                        ('session', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='leases', to='workers.workersession')),
                        ('worker', models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name='leases', to='workers.worker')),
                    ],
                    options={
                        'db_table': 'dispatch_runlease',
                        'ordering': ['-id'],
                        'permissions': [('revoke_lease', 'Can revoke an active lease')],
                        'indexes': [models.Index(condition=models.Q(('state', 'active')), fields=['id'], name='runlease_active'), models.Index(condition=models.Q(('state', 'active')), fields=['session'], name='runlease_active_session'), models.Index(condition=models.Q(('state', 'active')), fields=['expires_at'], name='runlease_active_expiry'), models.Index(fields=['session', 'pull_id'], name='runlease_pull')],
                        'constraints': [models.UniqueConstraint(condition=models.Q(('state', 'active')), fields=('attempt',), name='runlease_one_active'), models.UniqueConstraint(fields=('attempt', 'lease_generation'), name='runlease_unique_generation'), models.CheckConstraint(condition=models.Q(('state__in', ['active', 'released', 'expired', 'revoked'])), name='runlease_state_valid'), models.CheckConstraint(condition=models.Q(('source__in', ['new_claim', 'pull_claim'])), name='runlease_source_valid'), models.CheckConstraint(condition=models.Q(('lease_generation__gte', 1)), name='runlease_generation_gte_1')],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(forwards, backwards),
    ]
